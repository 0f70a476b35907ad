"""Parameter groups: the fields several configs share, each defined once.

MLflow params are flat, so a stage exposes the settings of the passes it runs (or of the steps
it launches) as its own fields. Each group below is a frozen dataclass holding some of those
fields, with their one type, one default, one help line (its docstring, in the form
:func:`mistill.stages.cli.field_meanings` reads) and one validation (:meth:`validate_group`). A
config takes a group by inheriting it (``class EventsConfig(Config, EventsParams, ChunkParams)``):
a field added to a group is then a param, a command-line option and an ``MLproject`` parameter
of every stage that takes the group, validated there, and passed on by
:meth:`~mistill.config.Config.shared_params` from a workflow's config to its steps' configs.

Groups are as fine as the stages' field sets require: a stage that takes only part of a
family (``own_heads`` takes ``n_null`` but not the other event settings) takes the smaller
group, which the larger one extends (:class:`EventsParams` extends :class:`NullParams`).

Which groups a stage takes is named in its config's class statement.
"""

from __future__ import annotations

from dataclasses import dataclass

from mistill.config import ParamGroup
from mistill.distill.cpu_bf16 import MODES
from mistill.evaluation.backends import BACKENDS
from mistill.evaluation.generation import DecodingConfig
from mistill.instrument.passes import DONOR_NO_MATCH, K_BINS
from mistill.validation import (check_choice, check_counts, check_interval, check_name, check_non_negative,
                                check_positive, fail)

P2C_CAPS = (0, 1, 2)
"""Accepted ``p2c_cap`` values: P2C events per (code, character) pair (0: uncapped)."""


# ------------------------------------------------------------------------------------ events
@dataclass(frozen=True)
class NullParams(ParamGroup):
    """The NULL events of a note (App. C).

    n_null: NULL positions per note (>= 0), at least ``null_min_distance`` tokens from any event.
    """

    n_null: int = 20

    def validate_group(self) -> None:
        check_non_negative(self.n_null, "n_null")


@dataclass(frozen=True)
class EventsParams(NullParams):
    """Event extraction (App. C).

    null_min_distance: tokens between a NULL position and any event (>= 0); p2c_cap: 2 (first
    mention + first repeat per pair), 1 (first mention) or 0 (uncapped).
    """

    null_min_distance: int = 8
    p2c_cap: int = 2

    def validate_group(self) -> None:
        check_non_negative(self.null_min_distance, "null_min_distance")
        if self.p2c_cap not in P2C_CAPS:
            fail(f"p2c_cap must be one of {P2C_CAPS} (0: uncapped), got {self.p2c_cap}", "p2c_cap")

    def extraction(self) -> dict[str, int]:
        """The keyword arguments of :func:`~mistill.instrument.events.extract_events` this group sets."""
        return {"n_null": self.n_null, "null_min_distance": self.null_min_distance, "p2c_cap": self.p2c_cap}


# ------------------------------------------------------------------------------ forward passes
@dataclass(frozen=True)
class ChunkParams(ParamGroup):
    """How a note's prefix is built.

    chunk_size: tokens per forward when a note's prefix is built (>= 1); trades memory for speed.
    """

    chunk_size: int = 8192

    def validate_group(self) -> None:
        check_positive(self.chunk_size, "chunk_size")


@dataclass(frozen=True)
class PatchParams(ChunkParams):
    """How patched forwards are batched.

    batch_size: patched variants (head sets) per batched forward (>= 1); trades memory for speed.
    """

    batch_size: int = 256

    def validate_group(self) -> None:
        check_positive(self.batch_size, "batch_size")


# -------------------------------------------------------------------------------------- edits
@dataclass(frozen=True)
class EditParams(ParamGroup):
    """The events and candidates of the edit stages (App. E, Tables 21-23).

    max_events: at most this many seeded P2C events with an earlier near-miss mention per note
    (>= 0; the paper: 20); at one seed the trace and the note edits draw the same events.
    max_tries: **[recon]** candidate replacements tried per replaced span before it goes
    without one (>= 1): each is tokenized and kept only where it aligns token for token.
    """

    max_events: int = 20
    max_tries: int = 64

    def validate_group(self) -> None:
        check_non_negative(self.max_events, "max_events")
        check_positive(self.max_tries, "max_tries")


# -------------------------------------------------------------------------------- attribution
@dataclass(frozen=True)
class StabilityParams(ParamGroup):
    """The split-half stability of the calibrated rankings (Table 15).

    stability_splits: split-half draws (>= 1).
    """

    stability_splits: int = 200

    def validate_group(self) -> None:
        check_positive(self.stability_splits, "stability_splits")


@dataclass(frozen=True)
class AttributeParams(StabilityParams):
    """The attribution pass (App. C–D).

    exact_p2: patch P2 and P2C events exactly too (App. C, the intact-hook re-run, and App. D,
    the exact contrastive refinement); False keeps them first-order, as the paper's first pass
    did. selftest_events: P1 events per note checked against exact patching of every head (>= 0;
    0: none), the first ones in visiting order. selftest_notes: the notes self-tested, the first
    this many of the pass in corpus order (>= 0; 0: every note). The paper checked ten P1 events
    of one note (``selftest_events=10``, ``selftest_notes=1``).
    """

    exact_p2: bool = True
    selftest_events: int = 0
    selftest_notes: int = 0

    def validate_group(self) -> None:
        check_non_negative(self.selftest_events, "selftest_events", "0: no self-test")
        check_non_negative(self.selftest_notes, "selftest_notes", "0: every note")


@dataclass(frozen=True)
class NomineeParams(ParamGroup):
    """The heads patched exactly at each event of the attribution pass (App. C–D): the event's
    top heads by ``|A_h|`` plus the first of the running global ranking.

    top_nominees, global_nominees: per P1 and NULL event (App. C: 40 and 16; >= 0).
    p2_top_nominees, p2_global_nominees: per P2 event when ``exact_p2`` (App. C, the intact-hook
    re-run: 24 and 8; >= 0).
    p2c_top_nominees, p2c_global_nominees: per P2C event when ``exact_p2`` (App. D, the exact
    contrastive refinement: 40 and 16; >= 0).
    """

    top_nominees: int = 40
    global_nominees: int = 16
    p2_top_nominees: int = 24
    p2_global_nominees: int = 8
    p2c_top_nominees: int = 40
    p2c_global_nominees: int = 16

    def validate_group(self) -> None:
        for name in ("top_nominees", "global_nominees", "p2_top_nominees", "p2_global_nominees",
                     "p2c_top_nominees", "p2c_global_nominees"):
            check_non_negative(getattr(self, name), name)


@dataclass(frozen=True)
class PoolParams(ParamGroup):
    """The pooled phase pools of the head sets (App. I.1).

    pool_k: heads per pooled phase pool (>= 1).
    """

    pool_k: int = 40

    def validate_group(self) -> None:
        check_positive(self.pool_k, "pool_k")


# ----------------------------------------------------------------------------------- knock-in
@dataclass(frozen=True)
class KnockinReadParams(ParamGroup):
    """Which knock-in events are read (App. C–D).

    range_gate: the donor's margin range gate in nats (>= 0; 0: no gate); events_per_phase: at
    most this many events per phase and note (0: every event).
    floor_draws: **[recon]** count-matched random draws per note, phase and bin measured beside
    the recorded floor (>= 1), to show its spread: the recorded random floor stays the paper's
    single seeded draw (App. K); draws 2.. are logged only as the floor's mean and standard
    deviation over draws (``.../random_floor_mean``, ``.../random_floor_sd``). They ride in the
    same knock-in batch as the other sets (no extra prefill).
    """

    range_gate: float = 1.0
    events_per_phase: int = 0
    floor_draws: int = 5

    def validate_group(self) -> None:
        check_non_negative(self.range_gate, "range_gate", "0: no gate")
        check_non_negative(self.events_per_phase, "events_per_phase", "0: every event")
        check_positive(self.floor_draws, "floor_draws")


@dataclass(frozen=True)
class KnockinParams(KnockinReadParams):
    """The set sizes of necessity and knock-in (App. D).

    k_bins: set sizes (each >= 1, no repeats).
    """

    k_bins: tuple[int, ...] = K_BINS

    def validate_group(self) -> None:
        check_counts(self.k_bins, "k_bins")


@dataclass(frozen=True)
class DonorParams(ParamGroup):
    """The donor rules of knock-in: each note's events are knocked into the next note in corpus
    order at a matched event with a different emitted choice (Sec. 2.3;
    :func:`~mistill.instrument.passes.plan_donors`).

    donor_wrap: **[recon]** the last note's donor is the first note (False: the last note gets
    no knock-in); donor_no_match: **[recon]** an event the next note cannot match is matched in
    the first later note that can (``next``) or left without a knock-in (``drop``).
    """

    donor_wrap: bool = True
    donor_no_match: str = "next"

    def validate_group(self) -> None:
        check_choice(self.donor_no_match, DONOR_NO_MATCH, "donor_no_match")


# ----------------------------------------------------------------------------------- decoding
@dataclass(frozen=True)
class TokenCapParams(ParamGroup):
    """The cap on a sampled completion (App. J.5).

    max_new_tokens: new tokens per sampled completion (>= 1; the paper: 16384).
    """

    max_new_tokens: int = 16384

    def validate_group(self) -> None:
        check_positive(self.max_new_tokens, "max_new_tokens")


@dataclass(frozen=True)
class BackendParams(ParamGroup):
    """The engine that samples.

    backend: ``auto`` (vLLM where it is installed and the device is CUDA, HF otherwise), ``hf``
        (HF ``generate``, notes in left-padded batches) or ``vllm`` (the optional extra); the run
        records the one that sampled (:func:`mistill.evaluation.backends.resolve_backend`).
    """

    backend: str = "auto"

    def validate_group(self) -> None:
        check_choice(self.backend, BACKENDS, "backend")


@dataclass(frozen=True)
class DecodingParams(TokenCapParams, BackendParams):
    """The paper's decoding (App. J.5: temperature 0.6, top-p 0.95, top-k 20); greedy decoding
    is not offered (it loops in thinking mode).

    temperature (> 0), top_p (in (0, 1]), top_k (>= 0; 0: no top-k): the decoding.
    """

    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 20

    def validate_group(self) -> None:
        check_positive(self.temperature, "temperature")
        check_interval(self.top_p, "top_p", low_open=True)
        check_non_negative(self.top_k, "top_k", "0: no top-k")

    def decoding(self) -> DecodingConfig:
        """The decoding settings, sampling from the config's ``seed`` (each note's seed derives
        from it): a config taking this group has a ``seed`` field."""
        return DecodingConfig(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_new_tokens=self.max_new_tokens, seed=self.seed)  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------------- recipe
@dataclass(frozen=True)
class RecipeParams(ParamGroup):
    """The optimisation recipe (App. J.2).

    epochs (>= 1), lr (> 0), warmup_frac (in [0, 1]), grad_accum (>= 1), clip (> 0): the recipe;
    max_steps: stop after this many optimizer steps (0: the epochs decide).
    gradient_checkpointing: recompute the student's layers in the backward pass (saves memory).
    tf32: **[recon]** float32 matmuls on CUDA in TF32 (the paper states no matmul precision; the
        recomputed attention rows' q.k inputs are bf16 projections); no effect on the CPU.
    cpu_bf16_matmul: how a bf16 student's matmuls run on the CPU: ``native`` (torch's bf16
        kernels), ``fp32`` (fp32 GEMMs on the exactly upcast bf16 operands, the result rounded
        to bf16: a bf16 GEMM's arithmetic, about 3x faster on CPUs without bf16 instructions),
        ``auto`` (``fp32`` on such CPUs, ``native`` elsewhere); no effect on CUDA
        (:mod:`mistill.distill.cpu_bf16`).
    sharding: how the weights are held over the processes of a launch: ``replicate`` (every rank
        a full copy, gradients all-reduced), ``fsdp`` (PyTorch's FSDP: each decoder layer a unit,
        weights, gradients and AdamW state sharded over the ranks), ``auto`` (``fsdp`` for the
        fp32-master-weight arms, whose full state is largest, ``replicate`` for bf16 weights and
        where FSDP does not apply: Feature-KD's adapter, the generation probe). One process
        always holds everything.
    checkpoint_every: optimizer steps between the resumable trainer checkpoints (0: none, and a
        crashed run starts over). A full-state checkpoint of a 4B student with its AdamW state is
        about 20 GB, written beside the previous one before it replaces it.
    """

    epochs: int = 2
    lr: float = 1e-5
    warmup_frac: float = 0.05
    grad_accum: int = 8
    clip: float = 1.0
    max_steps: int = 0
    gradient_checkpointing: bool = True
    tf32: bool = True
    cpu_bf16_matmul: str = "auto"
    sharding: str = "auto"
    checkpoint_every: int = 1

    def validate_group(self) -> None:
        check_choice(self.cpu_bf16_matmul, MODES, "cpu_bf16_matmul")
        check_non_negative(self.checkpoint_every, "checkpoint_every", "0: no checkpoints")
        check_choice(self.sharding, SHARDINGS, "sharding")
        check_positive(self.epochs, "epochs")
        check_positive(self.lr, "lr")
        check_interval(self.warmup_frac, "warmup_frac")
        check_positive(self.grad_accum, "grad_accum")
        check_positive(self.clip, "clip")
        check_non_negative(self.max_steps, "max_steps", "0: the epochs decide")



SHARDINGS = ("auto", "replicate", "fsdp")
"""How a training run's weights are held over the processes of a launch (:class:`RecipeParams`)."""


@dataclass(frozen=True)
class ProbeParams(ParamGroup):
    """The generation probe during training (App. L.2; :mod:`mistill.evaluation.probe`).

    probe_every: **[recon]** optimizer steps between probes, and one after the last step (0: no
        probe; the paper gives no interval).
    probe_notes: **[recon]** notes decoded per probe (>= 1): the first of ``probe_split`` in
        corpus order, the same at every probe.
    probe_split: the split the probe notes come from.
    probe_max_new_tokens: the probe's token cap (>= 1); its sampling is the evaluation's.
    probe_flag_share: **[recon]** a probe is flagged when the share of its answers' entries that
        are category codes, or the share of its generations that are truncated, reaches this.
    probe_backend: what samples the probe notes, as every sampling stage's ``backend``: ``auto``
        (vLLM where it is installed and the device is CUDA, else ``hf``), ``hf`` (transformers'
        batched generation with the model being trained) or ``vllm`` (**[recon]**: one engine
        for the whole run, built from the student as loaded, given the student's current weights
        at every probe; see :class:`mistill.evaluation.backends.SyncedVLLMBackend`). A run of
        several processes (torchrun) probes with ``hf`` (``auto`` resolves to it there, ``vllm``
        is refused). The run records the backend that sampled (tag ``mistill.probe_backend``).
    """

    probe_every: int = 0
    probe_notes: int = 4
    probe_split: str = "val"
    probe_max_new_tokens: int = 16384
    probe_flag_share: float = 0.5
    probe_backend: str = "auto"

    def validate_group(self) -> None:
        check_non_negative(self.probe_every, "probe_every", "0: no probe")
        check_positive(self.probe_notes, "probe_notes")
        check_name(self.probe_split, "probe_split", "a split")
        check_positive(self.probe_max_new_tokens, "probe_max_new_tokens")
        check_interval(self.probe_flag_share, "probe_flag_share", low_open=True)
        check_choice(self.probe_backend, BACKENDS, "probe_backend")


__all__ = ["P2C_CAPS", "NullParams", "EventsParams", "ChunkParams", "PatchParams", "StabilityParams",
           "AttributeParams", "PoolParams", "KnockinReadParams", "KnockinParams", "DonorParams",
           "TokenCapParams", "DecodingParams", "RecipeParams", "ProbeParams"]
