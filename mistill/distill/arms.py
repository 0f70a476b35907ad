"""Arms as data: one YAML file each under ``projects/configs/arms/``.

Every ablation names its ``base`` (Mistill or another arm) and the one flag it changes, so its
resolved configuration differs from its base exactly there (a test checks it). The resolved
:class:`ArmConfig` goes, with every other argument, into the run's ``config.json``.

An arm is named in one of two forms (:func:`arm_file`):

* a bare name (letters, digits, ``-``, ``_``): the file ``projects/configs/arms/<name>.yaml``
  (covered by the code version, like any file of the repository);
* an explicit path to a YAML file, recognised by its ``.yaml`` / ``.yml`` suffix (absolute, or
  relative to the working directory): an arm kept outside the repository, whose content the
  ``train`` stage adds to its run's identity (:func:`arm_digest`).

Anything else (``../x``, ``/etc/x``, a name with spaces) is refused. A ``base`` is always a
bare name.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from mistill.config import Config, file_digest
from mistill.errors import MistillInputError
from mistill.validation import (check_choice, check_choices, check_interval, check_non_negative, check_positive,
                                check_seed, is_arm_path)

ARMS_DIR = Path(__file__).resolve().parents[2] / "projects" / "configs" / "arms"
OBJECTIVES = ("cot", "mistill", "feature_kd", "distillm2", "opd", "gold")
ON_POLICY_OBJECTIVES = ("opd", "gold")
POOL_MODES = ("top", "bottom", "random", "random_all", "uniform")
TERMS = ("attention", "interaction", "write")
POSITIONS = ("events", "random")
PRECISIONS = ("bf16", "fp32")
FKD_LAYER_MAPS = ("block_end", "linspace")  # mistill.distill.losses.uniform_layer_pairs
FKD_HIDDEN_SITES = ("input", "output")
FKD_ADAPTERS = ("shared", "per_pair")
ULD_ALIGNMENTS = ("char_offset", "index")
ARM_NAME = re.compile(r"[A-Za-z0-9_-]+")


@dataclass(frozen=True)
class ArmConfig(Config):
    """What distinguishes one arm from another (App. J.3, M).

    lambda_p1, lambda_p2: weights (>= 0) of the Phase 1 and Phase 2 (P2 and P2C) terms.
    pool_k: heads in the student's pool (>= 1); pool_seed: seed of the random pool modes.
    window: rows supervised before each P1 event (>= 0; 0: none).
    event_weight, kl_weight: CE weight at event tokens and weight of the KL term (>= 0).
    attention_eps: clamp of both distributions inside the attention KL (Mistill's attention
        term and Feature-KD's). **[recon]**: the paper states no clamp.
    min_abs_margin: events whose teacher or student margin is below this (nats) leave the
        interaction and write terms; 0 (the default, the paper's rule: the interaction term
        averages over every event) drops none by size; see
        :func:`mistill.distill.objective.event_filter`. A positive value is an opt-in guard,
        **[recon]**: not in the paper. ``c`` divides by the margin, so the interaction term's
        gradient grows as 1 / margin^2; on the embedded default (``benchmarks/min_abs_margin.py``)
        one event at |margin| 0.018 made the term's gradient norm 10^4 times that with a 0.5-nat
        guard, which drops 22-29% of the events.
    uld_alignment: which teacher trace row serves each student trace row when the tokenizers
        differ (ULD; :func:`mistill.distill.objective.align_trace_rows`). **[recon]**.

    Feature-KD (App. J.3; ``objective: feature_kd``):
    fkd_pairs: layer pairs (4); fkd_positions: trace positions sampled per note for the
        attention term (64); the hidden-state term reads every trace position.
    fkd_layer_map: the "uniformly mapped" rule (:func:`~mistill.distill.losses.uniform_layer_pairs`).
        **[recon]**.
    fkd_hidden_site: the hidden state "at a layer": the residual stream entering it
        (``input``, the state its attention rows are recomputed from) or leaving it
        (``output``). **[recon]**.
    fkd_adapter: one linear adapter shared by the pairs (``shared``, the single ``W_h`` of
        TinyBERT) or one per pair (``per_pair``). **[recon]**.
    fkd_adapter_bias: whether the adapter has a bias. **[recon]**.
    fkd_rms_eps: epsilon inside the per-position RMS normalisation. **[recon]**.

    epochs: the arm's own number of epochs (0: the recipe's, two in the paper; the paper's GOLD
        run: one, a compute cut).

    On-policy arms (App. J.3; ``objective: opd``, :mod:`mistill.distill.onpolicy`; ``objective:
    gold``, :mod:`mistill.distill.gold`):
    rollout_cap: tokens per rollout of the student (the paper: 12,288 for OPD, 6,144 for GOLD,
        whose off-policy teacher traces are cut to the same cap);
    opd_beta: the generalised Jensen-Shannon divergence's beta (OPD's loss, 1: the reverse KL, as
        the paper; GOLD's hybrid loss uses it on the tokens both vocabularies share).
    on_policy_fraction: GOLD's share of on-policy micro-steps (TRL's ``lmbda``; the paper's run:
        0.5, after a fully on-policy run collapsed); OPD is fully on-policy.
    uld_hybrid: GOLD's hybrid ULD loss (JSD on the tokens both vocabularies share, ULD on the
        rest), the loss the paper's run used.
    """

    objective: str = "mistill"
    precision: str = "bf16"
    lambda_p1: float = 0.1
    lambda_p2: float = 0.1
    terms: tuple[str, ...] = ("attention", "interaction")
    write_norm: bool = False
    pool_mode: str = "top"
    pool_k: int = 40
    pool_seed: int = 0
    positions: str = "events"
    window: int = 8
    event_weight: float = 1.0
    kl_weight: float = 1.0
    attention_eps: float = 1e-8
    min_abs_margin: float = 0.0
    uld_alignment: str = "char_offset"
    fkd_pairs: int = 4
    fkd_positions: int = 64
    fkd_layer_map: str = "block_end"
    fkd_hidden_site: str = "input"
    fkd_adapter: str = "shared"
    fkd_adapter_bias: bool = True
    fkd_rms_eps: float = 1e-6
    epochs: int = 0
    rollout_cap: int = 12288
    opd_beta: float = 1.0
    on_policy_fraction: float = 1.0
    uld_hybrid: bool = True

    def validate(self) -> None:
        check_choice(self.objective, OBJECTIVES, "objective")
        check_choice(self.precision, PRECISIONS, "precision")
        check_choice(self.pool_mode, POOL_MODES, "pool_mode")
        check_choice(self.positions, POSITIONS, "positions")
        check_choices(self.terms, TERMS, "terms", non_empty=False)
        check_non_negative(self.lambda_p1, "lambda_p1")
        check_non_negative(self.lambda_p2, "lambda_p2")
        check_positive(self.pool_k, "pool_k")
        check_seed(self.pool_seed, "pool_seed")
        check_non_negative(self.window, "window", "0: no window rows")
        check_non_negative(self.event_weight, "event_weight")
        check_non_negative(self.kl_weight, "kl_weight", "0: cross-entropy only")
        check_non_negative(self.min_abs_margin, "min_abs_margin")
        check_positive(self.attention_eps, "attention_eps")
        check_choice(self.uld_alignment, ULD_ALIGNMENTS, "uld_alignment")
        check_positive(self.fkd_pairs, "fkd_pairs")
        check_positive(self.fkd_positions, "fkd_positions")
        check_choice(self.fkd_layer_map, FKD_LAYER_MAPS, "fkd_layer_map")
        check_choice(self.fkd_hidden_site, FKD_HIDDEN_SITES, "fkd_hidden_site")
        check_choice(self.fkd_adapter, FKD_ADAPTERS, "fkd_adapter")
        check_positive(self.fkd_rms_eps, "fkd_rms_eps")
        check_positive(self.rollout_cap, "rollout_cap")
        check_interval(self.opd_beta, "opd_beta")
        check_interval(self.on_policy_fraction, "on_policy_fraction")
        check_non_negative(self.epochs, "epochs", "0: the recipe's")

    @property
    def lambdas(self) -> dict[str, float]:
        return {"P1": self.lambda_p1, "P2": self.lambda_p2, "P2C": self.lambda_p2}


def arm_names(arms_dir: Path = ARMS_DIR) -> list[str]:
    return sorted(p.stem for p in arms_dir.glob("*.yaml"))


def arm_file(arm: str, arms_dir: Path = ARMS_DIR) -> Path:
    """The YAML file an arm names: ``<arms_dir>/<name>.yaml`` for a bare name, the path itself
    for an explicit ``.yaml`` / ``.yml`` path; anything else is refused (``field='arm'``)."""
    if is_arm_path(arm):
        path = Path(arm).expanduser()
        if not path.is_file():
            raise MistillInputError(f"no arm file at {arm!r}", file=arm, field="arm")
        return path
    if not ARM_NAME.fullmatch(arm):
        raise MistillInputError(
            f"arm {arm!r} is neither a bare arm name (letters, digits, '-', '_'; one of "
            f"{arm_names(arms_dir)}) nor an explicit path to a .yaml/.yml arm file", field="arm")
    path = arms_dir / f"{arm}.yaml"
    if not path.is_file():
        raise MistillInputError(f"unknown arm {arm!r}; arms: {arm_names(arms_dir)} (or give the path "
                                "of a .yaml arm file)", file=str(path), field="arm")
    return path


def arm_digest(arm: str) -> str | None:
    """sha256 of an explicitly given arm file (None for a bare name: the code version covers
    the repository's arms, and their bases are always bare names)."""
    return file_digest(Path(arm).expanduser()) if is_arm_path(arm) else None


def read_arm_file(name: str, arms_dir: Path = ARMS_DIR) -> dict:
    path = arm_file(name, arms_dir)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise MistillInputError(f"malformed arm file: {exc}", file=str(path), field="arm") from None
    if not isinstance(data, dict):
        raise MistillInputError("arm file must be a mapping", file=str(path), field="arm")
    return data


def arm_values(name: str, arms_dir: Path = ARMS_DIR, _seen: tuple[str, ...] = ()) -> dict:
    """The arm's flags with its bases resolved (description and base dropped)."""
    if name in _seen:
        raise MistillInputError(f"arm bases form a cycle: {' -> '.join(_seen + (name,))}", field="arm")
    data = read_arm_file(name, arms_dir)
    base = data.pop("base", None)
    data.pop("description", None)
    if base is not None and not (isinstance(base, str) and ARM_NAME.fullmatch(base)):
        raise MistillInputError(f"base {base!r} is not a bare arm name (letters, digits, '-', '_'; one of "
                                f"{arm_names(arms_dir)})", file=str(arm_file(name, arms_dir)), field="base")
    values = arm_values(base, arms_dir, _seen + (name,)) if base else {}
    values.update(data)
    return values


def parse_overrides(text: str) -> dict[str, str]:
    """``"lambda_p1=0.03,window=0"`` -> {"lambda_p1": "0.03", "window": "0"} (``terms=a+b`` for lists)."""
    out: dict[str, str] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise MistillInputError(f"override {item!r} is not key=value", field="overrides")
        out[key.strip()] = value.strip().replace("+", ",")
    return out


def resolve_arm(name: str, overrides: str | dict = "", arms_dir: Path = ARMS_DIR) -> ArmConfig:
    """The arm's configuration: defaults <- its file (and bases) <- overrides.

    Every flag is validated (:meth:`ArmConfig.validate`): an override such as ``lambda_p1=-1``
    is refused with ``field='lambda_p1'``.
    """
    values = arm_values(name, arms_dir)
    extra = parse_overrides(overrides) if isinstance(overrides, str) else dict(overrides)
    values.update(extra)
    source = str(arm_file(name, arms_dir)) + (f" with overrides {extra}" if extra else "")
    known = {f.name for f in dataclasses.fields(ArmConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise MistillInputError(f"unknown arm flag(s) {unknown}; known: {sorted(known)}", file=source,
                                field=unknown[0])
    return ArmConfig.from_dict(values, source=source)
