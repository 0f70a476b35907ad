"""The arms' objectives: the teacher's stored targets, and each micro-step's student side.

Teacher side (computed once, no online teacher): at every supervised row the pooled bucket
row ``a_T(r) = sum_h w_h bucketize(attn_h(r))`` over the teacher's pool for the row's phase (its
P1 window rows use the ``P1_window`` pool: the teacher's prose-time set when ``targets`` is given
one, else its P1 emission set, a departure from App. I.1 that the runs carry as the tag
``mistill.deviation=p1_window_pool=emission``), and at every event the region mass ``m_T`` and
the contribution ``c_T``; plus the top-32 next-token distribution at every trace position.

Student side (every micro-step): one forward of the student keeping the inputs of its pool
layers; the attention rows of the pooled heads are recomputed only at the supervised positions
(:mod:`mistill.distill.attention_rows`), bucketed on the same axis, and the same ``m`` and ``c``
read off them. Rows pair by event id (and, for window rows, by token distance).

The loss has two phases, two terms each (Sec. 2.2: "Phase 1 is P1; Phase 2 is P2 with its
contrastive case P2C"; Sec. 4.1, App. I.3, M.4: one weight per phase, ``lambda_P1`` and
``lambda_P2``). Each row is read through the pool of its own event kind (P1, P1 window, P2, P2C),
but a phase's attention term is one mean over all of the phase's rows and its interaction term one
mean over all of its events: Phase 2's P2 and P2C rows form one mean per term, weighted once by
``lambda_P2``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.utils.checkpoint
from torch.profiler import record_function

from mistill.distill.arms import ArmConfig
from mistill.distill.attention_rows import LayerInputs, contribution, in_plain_forward, layer_keys, region_mass
from mistill.distill.buckets import bucketize
from mistill.distill.losses import (attention_term, chunked_cot_loss, distillm2_loss, event_token_weights,
                                    feature_kd_loss, interaction_term, make_adapter, mistill_objective,
                                    sample_positions, uniform_layer_pairs, write_term)
from mistill.distill.note_data import NoteData
from mistill.distill.pools import Pool
from mistill.distill.rows import SupervisedRow, supervised_rows
from mistill.distill.targets import TargetEvent, TargetRow, teacher_targets
from mistill.errors import MistillInputError
from mistill.instrument.passes import stable_seed
from mistill.models.loading import LoadedModel

PHASES = ("P1", "P2")
"""The loss's phases, in the order their terms are computed: Phase 1 and Phase 2."""
KINDS = ("P1", "P2", "P2C")
"""The supervised event kinds, each read through its own pool."""
PHASE_OF_POOL = {"P1": "P1", "P1_window": "P1", "P2": "P2", "P2C": "P2"}
"""The phase whose terms a pool's rows enter (an event kind is its own pool's key)."""


# ------------------------------------------------------------------------------ teacher side

def teacher_row_keys(nd: NoteData, window: int) -> list[tuple[str, str, int, int, str]]:
    """The teacher's rows: ``(event_id, role, distance, position, pool key)``, events first."""
    rows = []
    for eid, r in sorted(nd.realized.items(), key=lambda kv: kv[1].position):
        rows.append((eid, "event", 0, r.position, r.event.kind))
        if r.event.kind == "P1":
            for d in range(1, window + 1):
                if r.position - d >= nd.trace_start:
                    rows.append((eid, "window", d, r.position - d, "P1_window"))
    return rows


def compute_note_targets(lm: LoadedModel, nd: NoteData, pools: Mapping[str, Pool], *, window: int = 8,
                         top_k: int = 32) -> dict[str, np.ndarray]:
    """The teacher's stored quantities for one note, with the row keys the student pairs on."""
    keys = teacher_row_keys(nd, window)
    event_ids = [k[0] for k in keys if k[1] == "event"]
    event_index = {eid: i for i, eid in enumerate(event_ids)}
    rows = [TargetRow(position=pos, phase=pool, bucket_map_key=eid if role == "event" else None,
                      event_index=event_index[eid] if role == "event" else None)
            for eid, role, _, pos, pool in keys]
    events = []
    for eid in event_ids:
        r = nd.realized[eid]
        events.append(TargetEvent(target_id=r.target_id, competitor_ids=tuple(r.competitor_ids),
                                  region=tuple(nd.region(eid))))
    out = teacher_targets(lm, nd.input_ids, nd.trace_start, rows, pools, nd.row_map, nd.axis.n, events,
                          top_k=top_k, note_id=nd.note.note_id)
    out["row_event_id"] = np.array([k[0] for k in keys], dtype=str)
    out["row_role"] = np.array([k[1] for k in keys], dtype=str)
    out["row_distance"] = np.array([k[2] for k in keys], dtype=np.int64)
    out["event_id"] = np.array(event_ids, dtype=str)
    out["n_buckets"] = np.array(nd.axis.n)
    return out


# ------------------------------------------------------------------------------ student side

@dataclass
class Pairing:
    """Student rows paired with the teacher's stored rows (indices into the target arrays)."""

    rows: list[SupervisedRow]
    teacher_row: np.ndarray  # [row] index into targets["pooled"]
    teacher_event: np.ndarray  # [row] index into targets["m"]/["c"] for event rows, -1 for window rows


def pair_rows(student: NoteData, teacher_realized, targets: Mapping[str, np.ndarray], *, window: int,
              teacher_trace_start: int) -> Pairing:
    rows = supervised_rows(list(teacher_realized), list(student.realized.values()), window=window,
                           teacher_trace_start=teacher_trace_start, student_trace_start=student.trace_start)
    index = {(e, r, int(d)): i for i, (e, r, d) in enumerate(zip(targets["row_event_id"], targets["row_role"],
                                                                   targets["row_distance"]))}
    ev_index = {e: i for i, e in enumerate(targets["event_id"])}
    kept, t_row, t_ev = [], [], []
    for r in rows:
        i = index.get((r.event_id, r.role, r.distance))
        if i is None:  # a window row the teacher's trace could not hold
            continue
        kept.append(r)
        t_row.append(i)
        t_ev.append(ev_index[r.event_id] if r.role == "event" else -1)
    return Pairing(rows=kept, teacher_row=np.array(t_row, dtype=np.int64), teacher_event=np.array(t_ev, dtype=np.int64))


def align_trace_rows(student: NoteData, teacher: NoteData, mode: str = "char_offset") -> np.ndarray:
    """Cross-tokenizer students (ULD): the teacher trace row whose top-32 serves each student
    trace row. ``[student trace tokens]`` indices into the teacher's top-32 arrays.

    **[recon]** (``ArmConfig.uld_alignment``). The paper says ULD "compares the teacher's and the
    student's sorted probabilities over the same number of bins and needs no shared vocabulary"
    (App. J.3), not which teacher position a student position is compared with:

    - ``"char_offset"`` (default): student trace row ``j`` (predicting student trace token
      ``j``) reads the teacher row predicting the teacher token that holds the first character
      of student token ``j`` (the last teacher token starting at or before it);
    - ``"index"``: row ``j`` reads teacher row ``min(j, n_T - 1)``, the position-index pairing of
      Boizard et al.'s ULD.
    """
    n_t = int(teacher.input_ids.numel()) - teacher.trace_start
    n_s = int(student.input_ids.numel()) - student.trace_start
    if mode == "index":
        return np.minimum(np.arange(n_s, dtype=np.int64), n_t - 1)
    if mode != "char_offset":
        raise MistillInputError(f"unknown ULD alignment {mode!r}", field="uld_alignment")
    t_starts = np.array([s for s, _ in teacher.inp.offsets[teacher.trace_start:]]) - teacher.inp.trace_offset
    out = []
    for s, _ in student.inp.offsets[student.trace_start:]:
        j = int(np.searchsorted(t_starts, s - student.inp.trace_offset, side="right") - 1)
        out.append(min(max(0, j), len(t_starts) - 1))
    return np.array(out, dtype=np.int64)


def random_positions(rows: Sequence[SupervisedRow], student: NoteData, seed: int) -> list[int]:
    """RandPos: each row moved to a trace position drawn with the seed (fixed per note)."""
    rng = np.random.default_rng(stable_seed(seed, student.note.note_id, "randpos"))
    n = int(student.input_ids.numel())
    return rng.integers(student.trace_start, n - 1, size=len(rows)).tolist()


def pooled_rows(hidden: Mapping[int, torch.Tensor], pool: Pool, lm: LoadedModel, positions: Sequence[int],
                maps: torch.Tensor, n_buckets: int, *, with_outputs: bool = False, checkpointed: bool = True):
    """Pooled bucket rows ``[row, bucket]`` of one pool (and per-layer head outputs for ``c``):
    :func:`pooled_row_sets` with a single row set.

    hidden: ``{layer: [pos, d_model]}`` inputs of the pool's layers; maps: ``[row, pos]``.
    """
    return pooled_row_sets(hidden, [RowSet(pool, list(positions), maps, with_outputs)], lm, n_buckets,
                           checkpointed=checkpointed)[0]


@dataclass
class RowSet:
    """Rows read through one pool: positions ``[row]``, bucket maps ``[row, pos]``, and whether the
    head outputs (for ``c``) are needed."""

    pool: Pool
    positions: list[int]
    maps: torch.Tensor
    with_outputs: bool = False


@dataclass
class LayerPlan:
    """One layer's share of the row sets: the union of the heads any set pools there, every
    set's rows concatenated, and per set its head columns, weights and row range."""

    layer: int
    union: torch.Tensor  # [u] heads within the layer
    rows: torch.Tensor  # [n] query positions, the sets' rows concatenated
    users: list[tuple[int, torch.Tensor, torch.Tensor, int, int]]  # (set, columns [h], weights [u], lo, hi)


def plan_row_sets(sets: Sequence[RowSet]) -> dict[int, LayerPlan]:
    """Group the row sets by the layers their pools touch."""
    device = sets[0].maps.device
    per_layer: dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for i, s in enumerate(sets):
        for layer, (heads, weights) in s.pool.by_layer().items():
            per_layer.setdefault(layer, []).append((i, heads, weights))
    plans = {}
    for layer, users in sorted(per_layer.items()):
        union = sorted({int(h) for _, heads, _ in users for h in heads})
        col = {h: j for j, h in enumerate(union)}
        out, lo = [], 0
        for i, heads, weights in users:
            w = torch.zeros(len(union), dtype=torch.float32)
            idx = torch.as_tensor([col[int(h)] for h in heads], dtype=torch.long)
            w[idx] = torch.as_tensor(weights, dtype=torch.float32)
            n = len(sets[i].positions)
            out.append((i, idx.to(device), w.to(device), lo, lo + n))
            lo += n
        rows = torch.as_tensor([p for i, _, _ in users for p in sets[i].positions], dtype=torch.long)
        plans[layer] = LayerPlan(layer, torch.as_tensor(union, dtype=torch.long, device=device),
                                 rows.to(device), out)
    return plans


def run_layer_plan(plan: LayerPlan, sets: Sequence[RowSet], lm: LoadedModel, hidden_l: torch.Tensor, *,
                   checkpointed: bool = True, row_chunk: int = 1024) -> tuple[torch.Tensor, ...]:
    """One layer's block: project the keys of the union heads once, recompute every set's rows
    (in chunks of ``row_chunk``) and pool each set's rows over its heads with its weights.

    hidden_l: ``[pos, d_model]``. Returns per user of the layer its pooled probabilities
    ``[rows, pos]`` (bucketed once, after the layers are summed: bucketing is linear) and its
    head outputs ``[rows, h, d_head]`` (empty when the set needs none). Under ``checkpointed``
    the block runs inside activation checkpointing: the backward recomputes it, so neither the
    keys nor the ``[row, head, pos]`` probabilities are kept."""
    g = lm.geometry
    parts = g.layers[plan.layer]

    def block(hidden_l):
        keys = layer_keys(parts, g, hidden_l, plan.union, torch.arange(hidden_l.shape[0], device=hidden_l.device))
        if any(sets[i].with_outputs for i, *_ in plan.users):
            keys.values  # noqa: B018 - projected inside the block, so its recompute matches
        pooled_parts = [[] for _ in plan.users]
        z_parts = [[] for _ in plan.users]
        for c0 in range(0, plan.rows.numel(), row_chunk):
            c1 = min(plan.rows.numel(), c0 + row_chunk)
            probs = keys.rows(plan.rows[c0:c1])  # [chunk rows, union heads, pos]
            for k, (i, idx, w, lo_k, hi_k) in enumerate(plan.users):
                lo, hi = max(lo_k, c0), min(hi_k, c1)
                if lo >= hi:
                    continue
                p = probs[lo - c0:hi - c0]
                pooled_parts[k].append(torch.einsum("rhp,h->rp", p, w))
                if sets[i].with_outputs:
                    z_parts[k].append(keys.outputs(p.index_select(1, idx), plan.union.index_select(0, idx)))
        res = []
        for k, (i, *_) in enumerate(plan.users):
            res.append(torch.cat(pooled_parts[k]))
            res.append(torch.cat(z_parts[k]) if sets[i].with_outputs else hidden_l.new_zeros(0))
        return tuple(res)

    if checkpointed and torch.is_grad_enabled():
        return torch.utils.checkpoint.checkpoint(block, hidden_l, use_reentrant=False)
    return block(hidden_l)


class RowSetSums:
    """Each set's pooled probabilities ``[row, pos]`` summed over the layers as their blocks
    arrive (a running sum, so no layer's block output outlives its addition), its per-layer head
    outputs, and at the end one bucketing per set."""

    def __init__(self, sets: Sequence[RowSet]) -> None:
        self.sets = list(sets)
        self.sums: list[torch.Tensor | None] = [None] * len(self.sets)
        self.outs: list[tuple[dict, dict, dict]] = [({}, {}, {}) for _ in self.sets]
        self.done: set[int] = set()

    def add(self, plan: LayerPlan, res: tuple[torch.Tensor, ...]) -> None:
        for k, (i, *_) in enumerate(plan.users):
            self.sums[i] = res[2 * k] if self.sums[i] is None else self.sums[i] + res[2 * k]
            if self.sets[i].with_outputs:
                heads, weights = self.sets[i].pool.by_layer()[plan.layer]
                o = self.outs[i]
                o[0][plan.layer], o[1][plan.layer], o[2][plan.layer] = res[2 * k + 1], heads, weights
        self.done.add(plan.layer)

    def bucketed(self, n_buckets: int) -> list[tuple[torch.Tensor, tuple[dict, dict, dict]]]:
        out = []
        for s, total, o in zip(self.sets, self.sums, self.outs):
            a = (torch.zeros(len(s.positions), n_buckets, dtype=torch.float32, device=s.maps.device)
                 if total is None else bucketize(total, s.maps, n_buckets))
            out.append((a, o))
        return out


def pooled_row_sets(hidden: Mapping[int, torch.Tensor], sets: Sequence[RowSet], lm: LoadedModel, n_buckets: int,
                    *, checkpointed: bool = True, row_chunk: int = 1024
                    ) -> list[tuple[torch.Tensor, tuple[dict, dict, dict]]]:
    """Pooled bucket rows for several row sets at once, from the kept layer inputs
    ``{layer: [pos, d_model]}``: per layer one :func:`run_layer_plan` block, summed over layers,
    bucketed once. Returns, per set, its ``[row, bucket]`` rows and its per-layer head outputs,
    heads and weights (for ``c``)."""
    sums = RowSetSums(sets)
    for layer, plan in plan_row_sets(sets).items():
        sums.add(plan, run_layer_plan(plan, sets, lm, hidden[layer], checkpointed=checkpointed,
                                      row_chunk=row_chunk))
    return sums.bucketed(n_buckets)


class RowSetBlocks:
    """Run each layer's block while the forward pass is at that layer (``LayerInputs``'
    ``on_input``), not after it.

    Why: a block's backward yields a dense ``[pos, d_model]`` gradient for its layer's input. Had
    the blocks been built after the forward, autograd (which runs the most recently created nodes
    first) would run them all at the start of the backward and hold one such gradient per pooled
    layer until the backward reached that layer (gigabytes at 30k tokens). Built during the
    forward, each block's backward runs just before its layer's. Where the layer input arrives
    inside an activation checkpoint's forward (a transformers release that checkpoints the whole
    module call; the trainer's own :func:`~mistill.distill.trainer.checkpoint_layers` does not),
    the block waits and :meth:`finish` runs it after the forward instead.
    """

    _eager_ok = True  # tests switch it off to compare with the deferred path

    def __init__(self, sets: Sequence[RowSet], lm: LoadedModel, n_buckets: int, *, row_chunk: int = 1024) -> None:
        self.sets, self.lm, self.n_buckets, self.row_chunk = list(sets), lm, n_buckets, row_chunk
        self.plans = plan_row_sets(self.sets) if self.sets else {}
        self.sums = RowSetSums(self.sets)

    @property
    def layers(self) -> list[int]:
        return sorted(self.plans)

    def __call__(self, layer: int, hidden: torch.Tensor) -> None:
        if self._eager_ok and layer in self.plans and layer not in self.sums.done and in_plain_forward():
            self.sums.add(self.plans[layer], run_layer_plan(self.plans[layer], self.sets, self.lm, hidden[0],
                                                            row_chunk=self.row_chunk))

    def finish(self, kept: LayerInputs) -> list[tuple[torch.Tensor, tuple[dict, dict, dict]]]:
        for layer, plan in self.plans.items():
            if layer not in self.sums.done:
                self.sums.add(plan, run_layer_plan(plan, self.sets, self.lm, kept[layer][0],
                                                   row_chunk=self.row_chunk))
        return self.sums.bucketed(self.n_buckets)


def micro_step_loss(model: torch.nn.Module, lm: LoadedModel, student: NoteData, targets: Mapping[str, np.ndarray],
                    pairing: Pairing, pools: Mapping[str, Pool], arm: ArmConfig, *, kl_mode: str = "kl",
                    logits_chunk: int = 1024, teacher_positions: np.ndarray | None = None):
    """The loss of one note for the ``cot`` and ``mistill`` objectives.

    ``L = L_CoT + lambda_P1 (L_attn,P1 + L_int,P1) + lambda_P2 (L_attn,P2 + L_int,P2)`` (with the
    arm's ``terms``): Phase 1's terms run over its P1 event rows and window rows, Phase 2's over
    its P2 and P2C rows together, one mean per term (:func:`_phase_terms`). A phase whose rows
    this note lacks contributes nothing.

    ``teacher_positions``: ``[student trace tokens]``, for cross-tokenizer students the teacher
    trace row whose top-32 serves each student trace row (ULD); ``None`` when the tokenizers agree.

    Returns ``(loss, parts)``: the scalar loss and float parts for logging: the CoT parts, ``loss``,
    and for each phase with non-zero lambda ``<phase>/<term>`` (the terms the loss sums) and
    ``<phase>/weighted``, phases ``P1`` and ``P2``. Diagnostics outside the loss:
    ``P2/attention/<kind>`` and ``P2/interaction/<kind>``, the same means restricted to the P2 or
    the P2C rows (events) of Phase 2, for each kind with rows (kept events) in the note.
    """
    g = lm.geometry
    device = next(model.parameters()).device
    ids = student.input_ids.to(device)
    mistill = (arm.objective == "mistill" and any(v > 0 for v in arm.lambdas.values())
               and bool(pairing.rows))
    # every row set of every supervised phase, planned before the forward so that each layer's
    # block runs while the forward is at that layer (RowSetBlocks)
    plan: list[tuple[str, str, list[int], RowSet]] = []
    positions: list[int] = []
    if mistill:
        with record_function("mistill/row_maps"):
            positions = ([r.student_pos for r in pairing.rows] if arm.positions == "events"
                         else random_positions(pairing.rows, student, arm.pool_seed))
            for kind in KINDS:  # each event kind's rows read through the kind's own pool
                if arm.lambdas[PHASE_OF_POOL[kind]] == 0:
                    continue
                idx = [i for i, r in enumerate(pairing.rows) if r.phase == kind]
                for role in ("event", "window"):
                    sel = [i for i in idx if pairing.rows[i].role == role]
                    if sel:
                        maps = student.row_maps([pairing.rows[i].event_id if role == "event" else None
                                                 for i in sel], device)
                        # the student's window rows read its own P1 pool (App. I.1)
                        plan.append((kind, role, sel, RowSet(pools[kind], [positions[i] for i in sel], maps,
                                                             with_outputs=role == "event")))
    blocks = RowSetBlocks([p[3] for p in plan], lm, student.axis.n)
    with LayerInputs(g, blocks.layers, final_residual=mistill, on_input=blocks) as kept:
        with record_function("mistill/forward"):
            hidden_last = final_hidden(model, ids)
        ts = student.trace_start
        n = ids.numel()
        top_ids = torch.as_tensor(targets["top_ids"], device=device)
        top_logp = torch.as_tensor(targets["top_logp"], device=device)
        if teacher_positions is not None:
            top_ids, top_logp = top_ids[teacher_positions], top_logp[teacher_positions]
        weights = None
        if arm.event_weight != 1.0:
            w_pos = [r.student_pos - ts + 1 for r in pairing.rows]  # rows predict the next token
            weights = event_token_weights(n - ts, [p for p in w_pos if 0 <= p < n - ts],
                                          factor=arm.event_weight, device=device)
        with record_function("mistill/cot"):
            cot, parts = chunked_cot_loss(hidden_last[ts - 1:n - 1], g.lm_head, ids[ts:], top_ids, top_logp,
                                          kl_weight=arm.kl_weight, token_weights=weights, chunk=logits_chunk,
                                          mode=kl_mode)
        logs = {k: float(v) for k, v in parts.items()}
        if not mistill:
            return cot, {"loss": float(cot.detach()), **logs}
        with record_function("mistill/row_sets"):
            computed = blocks.finish(kept)
        final = kept.final[0]
    with record_function("mistill/terms"):
        phase_terms, by_kind = _phase_terms(plan, computed, student, targets, pairing, positions, arm, g,
                                            hidden_last, final, device)
    # phases whose rows this note lacks contribute nothing (their lambda is applied to no term)
    complete = {p: t for p, t in phase_terms.items() if all(name in t for name in arm.terms)}
    lambdas = {p: (arm.lambdas[p] if p in complete else 0.0) for p in PHASES}
    total, parts = mistill_objective(cot, complete, lambdas, terms=tuple(arm.terms))
    logs.update({k: float(v) for k, v in parts.items()})
    entered = {k.split("/")[0] for k in parts if k.endswith("/weighted")}  # phases the loss holds
    logs.update({k: float(v) for k, v in by_kind.items() if k.split("/")[0] in entered})
    logs["loss"] = float(total.detach())
    return total, logs


def final_hidden(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The student's final-norm hidden states ``[pos, d_model]`` for ``ids`` ``[pos]``.

    The model is called as a whole, so that hooks on it run (FSDP gathers the embeddings, the
    final norm and the head in the root's), with the head on the last position only: the
    objective reads the head itself, chunk by chunk (``chunked_cot_loss``). FSDP warns that the
    outputs are views (an in-place op on one would skip its gradient hook); none is changed in
    place here, so the warning is silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        out = model(input_ids=ids.unsqueeze(0), use_cache=False, output_hidden_states=True, logits_to_keep=1)
    return out.hidden_states[-1][0]


def event_filter(teacher_margin: torch.Tensor, student_margin: torch.Tensor, teacher_c: torch.Tensor,
                 min_abs_margin: float) -> torch.Tensor:
    """Which events enter the interaction and write terms: ``[event]`` bool.

    ``c = (direct-path margin change) / margin``, so ``c`` is undefined at a margin of exactly 0
    and the teacher's stored ``c`` is then ``inf`` or ``NaN``: such events are always left out
    (whatever ``min_abs_margin``), as are events whose teacher ``c`` or either margin is not
    finite. **[recon]** (``ArmConfig.min_abs_margin``, not in the paper): events with
    ``|teacher margin| < min_abs_margin`` or ``|student margin| < min_abs_margin`` (nats) are
    left out too; 0 leaves out only the undefined ones.

    teacher_margin, student_margin, teacher_c: ``[event]`` (the student's margin detached).
    """
    t, s = teacher_margin.abs(), student_margin.abs()
    defined = (t > 0) & (s > 0) & torch.isfinite(t) & torch.isfinite(s) & torch.isfinite(teacher_c)
    return defined & (t >= min_abs_margin) & (s >= min_abs_margin)


def _phase_terms(plan, computed, student: NoteData, targets: Mapping[str, np.ndarray], pairing: Pairing,
                 positions: Sequence[int], arm: ArmConfig, g, hidden_last: torch.Tensor, final: torch.Tensor,
                 device: torch.device) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """Each supervised phase's terms from its recomputed rows, and Phase 2's per-kind diagnostics.

    plan: ``(kind, role, sel, RowSet)`` per row set, ``kind`` P1 / P2 / P2C and ``sel`` the row
    indices into ``pairing.rows``; computed: per row set its student rows ``[row, bucket]`` and,
    for event sets, its per-layer head outputs, heads and weights.

    A phase's row sets (Phase 1: the P1 event and window rows; Phase 2: the P2 and P2C event
    rows, each kind read through its own pool) are concatenated before each term is taken, so
    every term is one mean over the whole phase: the attention term over ``[row, bucket]``
    teacher and student rows of all of the phase's rows, the interaction (and write) term over
    ``[event]`` quantities of all of its events that pass :func:`event_filter`. Per-event
    quantities are gathered as whole tensors: no per-event host round trips.

    Returns ``(phase_terms, by_kind)``: ``{phase: {term: scalar}}`` for the phases with rows, and
    ``{"P2/<term>/<kind>": scalar}`` (detached) for the attention and interaction terms restricted
    to each kind present in Phase 2, logged only, never summed into the loss.
    """
    phase_terms: dict[str, dict[str, torch.Tensor]] = {}
    by_kind: dict[str, torch.Tensor] = {}
    for phase in PHASES:
        mine = [(kind, role, sel, res) for (kind, role, sel, _), res in zip(plan, computed)
                if PHASE_OF_POOL[kind] == phase]
        if not mine:
            continue
        terms: dict[str, torch.Tensor] = {}
        kinds = [kind for kind, *_ in mine]
        a_s_parts = [res[0] for *_, res in mine]  # [row, bucket] each
        a_t_parts = [torch.as_tensor(targets["pooled"][pairing.teacher_row[sel]], device=device)
                     for _, _, sel, _ in mine]
        if "attention" in arm.terms:
            terms["attention"] = attention_term(torch.cat(a_t_parts), torch.cat(a_s_parts), eps=arm.attention_eps)
        events = [(kind, sel, res[0], res[1]) for kind, role, sel, res in mine if role == "event"]
        ev_kinds: list[str] = []
        if events and ({"interaction", "write"} & set(arm.terms)):
            ev_kinds, ev_quantities = _event_quantities(events, student, targets, pairing, positions, arm, g,
                                                        hidden_last, final, device)
            m_s, c_s, m_t, c_t = ev_quantities
            if "interaction" in arm.terms:
                terms["interaction"] = interaction_term(m_s, c_s, m_t, c_t)
            if "write" in arm.terms:
                terms["write"] = write_term(c_s, c_t, normalize=arm.write_norm)
        phase_terms[phase] = terms
        if phase != "P2":
            continue
        # diagnostics: the same means over one kind's rows (events) of Phase 2, outside the loss
        with torch.no_grad():
            for kind in KINDS:
                rows = [i for i, k in enumerate(kinds) if k == kind]
                if not rows:
                    continue
                if "attention" in terms:
                    by_kind[f"P2/attention/{kind}"] = attention_term(
                        torch.cat([a_t_parts[i] for i in rows]), torch.cat([a_s_parts[i] for i in rows]).detach(),
                        eps=arm.attention_eps)
                if "interaction" in terms and kind in ev_kinds:
                    keep = torch.as_tensor([k == kind for k in ev_kinds], dtype=torch.bool, device=device)
                    by_kind[f"P2/interaction/{kind}"] = interaction_term(*(q.detach()[keep] for q in ev_quantities))
    return phase_terms, by_kind


def _event_quantities(events, student: NoteData, targets: Mapping[str, np.ndarray], pairing: Pairing,
                      positions: Sequence[int], arm: ArmConfig, g, hidden_last: torch.Tensor,
                      final: torch.Tensor, device: torch.device
                      ) -> tuple[list[str], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """One phase's per-event quantities over all of its event row sets, concatenated in order.

    events: per event row set ``(kind, sel, a_s [event, bucket], (z, heads, w))``, each set's
    ``c`` computed through its own pool. The event filter runs once over the phase's events.

    Returns ``(kinds, (m_S, c_S, m_T, c_T))``: the kind of each kept event and the four ``[event]``
    tensors of the kept events (the student's carry the graph).
    """
    tables, margins, teacher = [], [], []
    for kind, sel, a_s, _ in events:
        target, comp, region = student.event_tables([pairing.rows[i].event_id for i in sel], device)
        pos_t = torch.as_tensor([positions[i] for i in sel], device=device)
        logits = g.lm_head(hidden_last.index_select(0, pos_t)).float()  # [event, vocab]
        comp_logits = logits.gather(1, comp.clamp_min(0)).masked_fill(comp < 0, float("-inf"))
        margins.append(logits.gather(1, target.unsqueeze(1))[:, 0] - torch.logsumexp(comp_logits, dim=-1))
        tables.append((pos_t, target, comp, region, comp_logits))
        ev = pairing.teacher_event[sel]
        teacher.append([torch.as_tensor(targets[key][ev], device=device, dtype=torch.float32)
                        for key in ("m", "c", "margin")])
    m_t, c_t, t_margin = (torch.cat([t[j] for t in teacher]) for j in range(3))
    ok = event_filter(t_margin, torch.cat(margins).detach(), c_t, arm.min_abs_margin)
    oks = ok.split([len(sel) for _, sel, _, _ in events])
    m_s, c_s, kinds = [], [], []
    for (kind, sel, a_s, (z, heads, w)), (pos_t, target, comp, region, comp_logits), margin, ok_k in zip(
            events, tables, margins, oks):
        # c divides by the margin: a left-out event must not reach the backward as 0 * inf
        safe = torch.where(ok_k, margin, torch.ones_like(margin))
        c_s.append(contribution(z, heads, w, g, final.index_select(0, pos_t), target, comp, comp_logits, safe))
        m_s.append(region_mass(a_s, region))
        kinds += [kind] * int(ok_k.sum())
    return kinds, (torch.cat(m_s)[ok], torch.cat(c_s)[ok], m_t[ok], c_t[ok])


# ------------------------------------------------------------------------------ Feature-KD

@dataclass
class FeatureKD:
    """What the Feature-KD arm needs beyond the CoT targets: the online teacher, the layer pairs
    and the adapter(s) (App. J.3: four uniformly mapped layer pairs; head-averaged bucket-pooled
    attention KL at 64 trace positions sampled per note; RMS-normalised hidden-state MSE through
    a linear adapter at every trace position; weights 1 and 1).

    adapter: one ``nn.Linear(d_S -> d_T)`` shared by the pairs, or a ``ModuleList`` with one per
    pair (``ArmConfig.fkd_adapter``). n_positions: the attention term's sampled positions per
    note (``ArmConfig.fkd_positions``). hidden_site: ``ArmConfig.fkd_hidden_site``. hidden_chunk:
    trace positions per chunk of the hidden term (memory only; the loss does not depend on it).
    """

    teacher: LoadedModel
    pairs: list[tuple[int, int]]
    adapter: torch.nn.Linear | torch.nn.ModuleList
    n_positions: int = 64
    hidden_site: str = "input"
    rms_eps: float = 1e-6
    hidden_chunk: int = 1024

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.adapter.parameters())


def make_feature_kd(teacher: LoadedModel, student: LoadedModel, arm: ArmConfig, seed: int, *,
                    device: torch.device | str | None = None) -> FeatureKD:
    """The arm's :class:`FeatureKD` from its flags: the layer pairs by ``fkd_layer_map``, the
    adapter(s) drawn from the run's seed (pair ``k`` of ``per_pair`` from ``stable_seed(seed,
    "feature-kd-adapter", k)``)."""
    d_s, d_t = student.geometry.d_model, teacher.geometry.d_model
    pairs = uniform_layer_pairs(student.geometry.n_layers, teacher.geometry.n_layers, arm.fkd_pairs,
                                rule=arm.fkd_layer_map)
    if arm.fkd_adapter == "shared":
        adapter = make_adapter(d_s, d_t, seed, bias=arm.fkd_adapter_bias, device=device)
    else:
        adapter = torch.nn.ModuleList(
            make_adapter(d_s, d_t, stable_seed(seed, "feature-kd-adapter", k) % 2 ** 63,
                         bias=arm.fkd_adapter_bias, device=device) for k in range(len(pairs)))
    return FeatureKD(teacher=teacher, pairs=pairs, adapter=adapter, n_positions=arm.fkd_positions,
                     hidden_site=arm.fkd_hidden_site, rms_eps=arm.fkd_rms_eps)


def _layer_pool(lm: LoadedModel, layer: int) -> Pool:
    n = lm.geometry.n_heads
    return Pool(heads=tuple(range(layer * n, (layer + 1) * n)), weights=(1.0 / n,) * n,
                name=f"L{layer}:all", n_heads=n)


def feature_kd_positions(student: NoteData, seed: int, k: int) -> torch.Tensor:
    """The attention term's positions: ``k`` of the student's trace positions drawn uniformly
    without replacement with ``(seed, note)`` (the same draw every epoch), sorted, as indices
    relative to the trace start ``[min(k, trace tokens)]``."""
    gen = torch.Generator().manual_seed(stable_seed(seed, student.note.note_id, "feature-kd") % 2 ** 63)
    return sample_positions(int(student.input_ids.numel()) - student.trace_start, k, gen)


def _hidden_layers(pairs_side: Sequence[int], site: str) -> list[int]:
    """The layers whose inputs hold each pair layer's hidden state: the layer itself
    (``input``) or the next one (``output``; ``-1`` for the last layer: the final residual)."""
    return list(pairs_side) if site == "input" else [l + 1 for l in pairs_side]


def _hidden_at(kept: LayerInputs, layer: int, n_layers: int) -> torch.Tensor:
    """``[pos, d_model]``: the input of ``layer``, or the final residual when ``layer`` is past
    the last layer."""
    return kept.final[0] if layer >= n_layers else kept[layer][0]


def feature_kd_step(model: torch.nn.Module, lm: LoadedModel, student: NoteData, teacher_nd: NoteData,
                    targets: Mapping[str, np.ndarray], fkd: FeatureKD, arm: ArmConfig, *, seed: int,
                    kl_mode: str = "kl", logits_chunk: int = 1024, teacher_positions: np.ndarray | None = None):
    """One note's Feature-KD loss: ``L_CoT + feature_kd_loss`` (weights 1 and 1).

    Attention term: ``fkd.n_positions`` (64) trace positions of the student drawn with (seed,
    note) (:func:`feature_kd_positions`); hidden-state term: every trace position of the student.
    Student trace token ``j`` reads the teacher at teacher trace token ``teacher_positions[j]``
    (the token holding the same first character, :func:`align_trace_rows`), or at ``j`` when the
    tokenizers agree.
    """
    g = lm.geometry
    device = next(model.parameters()).device
    ids = student.input_ids.to(device)
    ts, n = student.trace_start, ids.numel()
    rel = feature_kd_positions(student, seed, fkd.n_positions)
    s_pos = (rel + ts).tolist()
    t_rel_all = np.arange(n - ts) if teacher_positions is None else np.asarray(teacher_positions)
    t_pos = (t_rel_all[rel.numpy()] + teacher_nd.trace_start).tolist()
    t_all = torch.as_tensor(t_rel_all + teacher_nd.trace_start, dtype=torch.long, device=device)
    s_layers = sorted({s for s, _ in fkd.pairs})
    t_layers = sorted({t for _, t in fkd.pairs})
    tg = fkd.teacher.geometry
    t_h_layers = _hidden_layers([t for _, t in fkd.pairs], fkd.hidden_site)
    s_h_layers = _hidden_layers([s for s, _ in fkd.pairs], fkd.hidden_site)
    t_keep = sorted(set(t_layers) | {l for l in t_h_layers if l < tg.n_layers})
    s_keep = sorted(set(s_layers) | {l for l in s_h_layers if l < g.n_layers})
    t_final = any(l >= tg.n_layers for l in t_h_layers)
    s_final = any(l >= g.n_layers for l in s_h_layers)
    with torch.no_grad(), LayerInputs(tg, t_keep, final_residual=t_final) as tk:
        fkd.teacher.model.model(input_ids=teacher_nd.input_ids.to(device).unsqueeze(0), use_cache=False)
        t_hidden = {l: tk[l][0] for l in t_layers}
        t_maps = teacher_nd.base_map.to(device).unsqueeze(0).expand(len(t_pos), -1)
        a_t = torch.stack([pooled_rows(t_hidden, _layer_pool(fkd.teacher, t), fkd.teacher, t_pos, t_maps,
                                       teacher_nd.axis.n)[0] for _, t in fkd.pairs])
        # every trace position, in the teacher's dtype (cast chunk by chunk inside the loss)
        h_t = [_hidden_at(tk, l, tg.n_layers).index_select(0, t_all) for l in t_h_layers]
    with LayerInputs(g, s_keep, final_residual=s_final) as kept:
        hidden_last = final_hidden(model, ids)
        top_ids = torch.as_tensor(targets["top_ids"], device=device)
        top_logp = torch.as_tensor(targets["top_logp"], device=device)
        if teacher_positions is not None:
            top_ids, top_logp = top_ids[teacher_positions], top_logp[teacher_positions]
        cot, parts = chunked_cot_loss(hidden_last[ts - 1:n - 1], g.lm_head, ids[ts:], top_ids, top_logp,
                                      kl_weight=arm.kl_weight, chunk=logits_chunk, mode=kl_mode)
        s_hidden = {l: kept[l][0] for l in s_layers}
        s_maps = student.base_map.to(device).unsqueeze(0).expand(len(s_pos), -1)
        a_s = torch.stack([pooled_rows(s_hidden, _layer_pool(lm, s), lm, s_pos, s_maps, student.axis.n)[0]
                           for s, _ in fkd.pairs])
        h_s = [_hidden_at(kept, l, g.n_layers)[ts:n] for l in s_h_layers]  # views: no copy
        adapters = fkd.adapter if isinstance(fkd.adapter, torch.nn.Linear) else list(fkd.adapter)
        fk, fparts = feature_kd_loss(a_t, a_s, h_t, h_s, adapters, eps=arm.attention_eps, rms_eps=fkd.rms_eps,
                                     hidden_chunk=fkd.hidden_chunk)
    total = cot + fk
    logs = {k: float(v) for k, v in parts.items()} | {f"feature_kd/{k}": float(v) for k, v in fparts.items()}
    logs["feature_kd/n_attn_positions"] = float(len(s_pos))
    logs["feature_kd/n_hidden_positions"] = float(n - ts)
    logs["loss"] = float(total.detach())
    return total, logs


# ------------------------------------------------------------------------------ DistiLLM-2

def distillm2_step(model: torch.nn.Module, lm: LoadedModel, teacher: LoadedModel, student: NoteData,
                   dispreferred_ids: Sequence[int], *, chunk: int = 1024):
    """One note's DistiLLM-2 loss: the teacher trace preferred, the untrained student's own
    generation for the same prompt dispreferred, the teacher online (shared vocabulary).

    Both sequences are the note's prompt followed by the response; logits are read at the rows
    predicting response tokens.
    """
    device = next(model.parameters()).device
    ts = student.trace_start
    prompt = student.input_ids[:ts]
    pref = student.input_ids.to(device)
    dispref = torch.cat([prompt, torch.as_tensor(list(dispreferred_ids), dtype=torch.long)]).to(device)

    def logits(m, ids):
        return m(input_ids=ids.unsqueeze(0), use_cache=False).logits[0, ts - 1:ids.numel() - 1]

    with torch.no_grad():
        t_pref, t_dis = logits(teacher.model, pref).float(), logits(teacher.model, dispref).float()
    s_pref, s_dis = logits(model, pref), logits(model, dispref)
    loss, parts = distillm2_loss(s_pref, t_pref, pref[ts:], s_dis, t_dis, dispref[ts:], chunk=chunk)
    logs = {f"distillm2/{k}": float(v) for k, v in parts.items()}
    logs["loss"] = float(loss.detach())
    return loss, logs
