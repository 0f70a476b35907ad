"""The teacher side of Mistill, computed once per note (paper App. I.5; docs/METHOD.md).

One forward of the teacher over the note's prompt + trace, without gradients, keeps the input
hidden states of the layers its pools touch (:class:`~mistill.distill.attention_rows.LayerInputs`)
and the residual stream entering the final norm. From them, per note:

- ``top_ids``, ``top_logp`` ``[trace_pos, top_k]``: the teacher's top-``k`` next-token
  log-probabilities (``log_softmax`` over the whole vocabulary, float32) at every position whose
  next token is a trace token, by log-probability descending, exact ties by lower token id
  (:func:`top_k_lowest_id_first`). Entry ``i`` is the distribution over the token at position
  ``trace_start + i``, read at position ``trace_start + i - 1``; ``trace_pos = pos - trace_start``.
- ``rows_pos`` ``[row]``: the supervised rows' positions; ``rows_phase`` ``[row]`` their phases.
- ``pooled`` ``[row, bucket]``: ``a_bar(r) = sum_h w_h bucketize(attn_h(r))`` over the pool of
  the row's phase, ``attn_h(r)`` recomputed by
  :func:`~mistill.distill.attention_rows.attention_rows` and ``bucketize`` summing each key's
  attention into its span bucket (``bucket_maps``). Weights are used as given (a softmax pool
  sums to 1, and so does each row).
- ``m`` ``[event]``: pooled attention on the event's region buckets (``region_mass``).
- ``c`` ``[event]``: the pool's direct-path contribution over the clean margin
  (:func:`~mistill.distill.attention_rows.contribution`), with head outputs rebuilt from the
  same rows; ``margin`` ``[event]`` the clean margin; ``event_row`` ``[event]`` its row.
- ``trace_start``: 0-d.

``top_ids`` / ``top_logp`` are model text: decoding the top-1 ids recovers most trace tokens.
For a restricted corpus the ``targets`` stage keeps the arrays in its local enclave and uploads
only :func:`targets_manifest` (names, shapes, dtypes, sha256; no values).

The inputs are plain data (:class:`TargetRow`, :class:`TargetEvent`, any pool with flat
``heads`` and ``weights``, a function giving each row's token-to-bucket map), so this module
does not depend on how buckets, rows or pools are built.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from mistill.distill.attention_rows import LayerInputs, contribution, layer_keys, region_mass
from mistill.errors import MistillInputError
from mistill.instrument.events import margin as margin_of
from mistill.io import atomic_open
from mistill.models.loading import LoadedModel

__all__ = ["TargetRow", "TargetEvent", "PoolLike", "FlatPool", "teacher_targets", "save_targets",
           "load_targets", "targets_manifest", "top_k_lowest_id_first", "TARGET_KEYS"]

TARGET_KEYS: tuple[str, ...] = ("top_ids", "top_logp", "rows_pos", "rows_phase", "pooled", "m", "c",
                                "margin", "event_row", "trace_start")


@dataclass(frozen=True)
class TargetRow:
    """One supervised row.

    Attributes:
        position: token position ``q`` of the row (the query).
        phase: key of the pool that reads this row (e.g. ``"P1"``, ``"P2"``, ``"P2C"``, or a
            window key whose pool is the teacher's prose-time set).
        bucket_map_key: passed to ``bucket_maps`` (rows with carve-outs have their own map).
        event_index: index into the events list when the row is an event's position, else None.
    """

    position: int
    phase: str
    bucket_map_key: Hashable = None
    event_index: int | None = None


@dataclass(frozen=True)
class TargetEvent:
    """What ``m`` and ``c`` need of one event: the teacher's target and competitor token ids,
    and the event's region as bucket indices in its row's bucket map."""

    target_id: int
    competitor_ids: tuple[int, ...]
    region: tuple[int, ...]


class PoolLike(Protocol):
    """A pool: flat head indices (``layer * n_heads + head``) and their weights ``w_h``."""

    heads: Sequence[int]
    weights: Sequence[float]


@dataclass(frozen=True)
class FlatPool:
    """The minimal :class:`PoolLike`."""

    heads: tuple[int, ...]
    weights: tuple[float, ...]


def _err(message: str, field: str, note: str | None) -> MistillInputError:
    return MistillInputError(message, note=note, field=field)


def _pool_tensors(pools: Mapping[str, PoolLike], phases: set[str], n_total: int,
                  note: str | None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    out = {}
    for phase in sorted(phases):
        if phase not in pools:
            raise _err(f"no pool for phase {phase!r} (pools: {sorted(pools)})", "pools", note)
        heads = torch.as_tensor(list(pools[phase].heads), dtype=torch.long).reshape(-1)
        weights = torch.as_tensor(list(pools[phase].weights), dtype=torch.float32).reshape(-1)
        if heads.numel() == 0 or heads.numel() != weights.numel():
            raise _err(f"pool {phase!r}: {heads.numel()} heads and {weights.numel()} weights",
                       "pools", note)
        if int(heads.min()) < 0 or int(heads.max()) >= n_total or heads.unique().numel() != heads.numel():
            raise _err(f"pool {phase!r}: head indices must be distinct and in 0..{n_total - 1}", "pools", note)
        out[phase] = (heads, weights)
    return out


def _validate(rows: Sequence[TargetRow], events: Sequence[TargetEvent], n_pos: int, trace_start: int,
              vocab: int, n_buckets: int, note: str | None) -> list[int]:
    """Check the inputs; return each event's row index."""
    if not 1 <= trace_start < n_pos:
        raise _err(f"trace_start {trace_start} must lie in 1..{n_pos - 1} (a non-empty trace after "
                   "at least one prompt token)", "trace_start", note)
    event_row = [-1] * len(events)
    for i, r in enumerate(rows):
        if not 0 <= r.position < n_pos:
            raise _err(f"row {i}: position {r.position} outside 0..{n_pos - 1}", "rows", note)
        if r.event_index is not None:
            if not 0 <= r.event_index < len(events):
                raise _err(f"row {i}: event index {r.event_index} outside 0..{len(events) - 1}", "rows", note)
            if event_row[r.event_index] != -1:
                raise _err(f"event {r.event_index} has more than one row", "rows", note)
            event_row[r.event_index] = i
    missing = [e for e, r in enumerate(event_row) if r == -1]
    if missing:
        raise _err(f"events {missing[:5]} have no row", "events", note)
    for e, ev in enumerate(events):
        ids = [ev.target_id, *ev.competitor_ids]
        if not ev.competitor_ids or min(ids) < 0 or max(ids) >= vocab:
            raise _err(f"event {e}: needs competitors, all ids in 0..{vocab - 1}", "events", note)
        if any(not 0 <= b < n_buckets for b in ev.region):
            raise _err(f"event {e}: region buckets outside 0..{n_buckets - 1}", "events", note)
    return event_row


def top_k_lowest_id_first(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest entries of each row: ``x [row, vocab] -> (values, ids)``, each
    ``[row, k]``, by value descending and, among exactly equal values, by lower id.

    ``torch.topk`` leaves the choice and order among tied entries to its kernel (device,
    version); here the k-th largest value decides membership, entries equal to it fill the free
    slots lowest id first, and a stable sort orders the kept entries. A row holding NaN keeps
    ``torch.topk``'s choice of entries (NaN compares equal to nothing).
    """
    top = x.topk(k, dim=-1)
    kth = top.values[:, -1:]                                   # [row, 1]
    above = x > kth                                             # [row, vocab]
    at = x == kth
    need = k - above.sum(-1, keepdim=True)                      # slots left for the ties
    take = above | at
    crowded = (at.sum(-1, keepdim=True) > need).squeeze(-1)     # more ties than free slots
    if bool(crowded.any()):
        rows = crowded.nonzero().squeeze(-1)
        ties = at[rows]
        take[rows] = above[rows] | (ties & (ties.cumsum(-1) <= need[rows]))
    nan_rows = take.sum(-1) != k                                # only rows holding NaN
    if bool(nan_rows.any()):
        take[nan_rows] = torch.zeros_like(take[nan_rows]).scatter_(-1, top.indices[nan_rows], True)
    ids = take.nonzero()[:, 1].view(x.shape[0], k)              # ascending ids per row
    values = x.gather(-1, ids)
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices
    return values.gather(-1, order), ids.gather(-1, order)


def _bucket_map(bucket_maps: Callable[[Hashable], Any], key: Hashable, n_pos: int, n_buckets: int,
                device: torch.device, note: str | None) -> torch.Tensor:
    m = torch.as_tensor(bucket_maps(key), dtype=torch.long, device=device).reshape(-1)
    if m.numel() != n_pos:
        raise _err(f"bucket map {key!r} has {m.numel()} entries for {n_pos} tokens", "bucket_maps", note)
    if int(m.min()) < 0 or int(m.max()) >= n_buckets:
        raise _err(f"bucket map {key!r}: bucket indices outside 0..{n_buckets - 1}", "bucket_maps", note)
    return m


@torch.no_grad()
def teacher_targets(lm: LoadedModel, note_input_ids: Sequence[int] | torch.Tensor, trace_start: int,
                    rows: Sequence[TargetRow], pools: Mapping[str, PoolLike],
                    bucket_maps: Callable[[Hashable], Any], n_buckets: int,
                    events: Sequence[TargetEvent], *, top_k: int = 32, row_chunk: int = 128,
                    logit_chunk: int = 512, note_id: str | None = None) -> dict[str, np.ndarray]:
    """The teacher's stored quantities for one note (see the module docstring for each array).

    Args:
        lm: the teacher.
        note_input_ids: ``[pos]`` token ids of prompt + trace.
        trace_start: position of the first trace token.
        rows: the supervised rows; an event's row carries its ``event_index``.
        pools: phase -> pool (flat heads, weights).
        bucket_maps: ``key -> [pos]`` bucket index of every token, called once per distinct
            ``TargetRow.bucket_map_key``.
        n_buckets: size of the bucket axis.
        events: ``[event]`` target / competitor ids and region buckets.
        top_k: how many next-token log-probs to keep per trace position.
        row_chunk: rows recomputed at once (bounds ``[row, head, pos]`` memory).
        logit_chunk: positions unembedded at once (bounds ``[pos, vocab]`` memory).
    Returns:
        numpy arrays keyed by :data:`TARGET_KEYS`.
    """
    g = lm.geometry
    model = lm.model
    device = g.embed.weight.device
    ids = torch.as_tensor(note_input_ids, dtype=torch.long).reshape(-1).to(device)
    n_pos = ids.numel()
    if not 0 < top_k <= g.vocab:
        raise _err(f"top_k {top_k} outside 1..{g.vocab}", "top_k", note_id)
    event_row = _validate(rows, events, n_pos, trace_start, g.vocab, n_buckets, note_id)
    phases = {r.phase for r in rows}
    pool_t = _pool_tensors(pools, phases, g.n_total_heads, note_id)
    layers = sorted({int(l) for heads, _ in pool_t.values() for l in (heads // g.n_heads).tolist()})

    with LayerInputs(g, layers, final_residual=True) as kept:
        model(input_ids=ids.unsqueeze(0), use_cache=False, logits_to_keep=1)
        hidden = {l: kept[l][0] for l in layers}
        final = kept.final[0]

    # top-k next-token log-probs at the positions predicting trace tokens
    pred = torch.arange(trace_start - 1, n_pos - 1, device=device)
    top_ids = torch.empty(pred.numel(), top_k, dtype=torch.long, device=device)
    top_logp = torch.empty(pred.numel(), top_k, dtype=torch.float32, device=device)
    for s in range(0, pred.numel(), logit_chunk):
        p = pred[s:s + logit_chunk]
        logp = torch.log_softmax(g.lm_head(g.final_norm(final.index_select(0, p))).float(), dim=-1)
        top_logp[s:s + p.numel()], top_ids[s:s + p.numel()] = top_k_lowest_id_first(logp, top_k)

    # pooled bucket rows, and the pools' head outputs at event rows
    positions = torch.tensor([r.position for r in rows], dtype=torch.long, device=device)
    maps: dict[Hashable, torch.Tensor] = {}
    for r in rows:
        if r.bucket_map_key not in maps:
            maps[r.bucket_map_key] = _bucket_map(bucket_maps, r.bucket_map_key, n_pos, n_buckets,
                                                 device, note_id)
    pooled = torch.zeros(len(rows), n_buckets, dtype=torch.float32, device=device)
    rows_of = {ph: [i for i, r in enumerate(rows) if r.phase == ph] for ph in sorted(phases)}
    # per phase: event slots (order of the phase's event rows) and z per layer
    ev_rows_of = {ph: [i for i in idx if rows[i].event_index is not None] for ph, idx in rows_of.items()}
    slot = {i: k for ph in ev_rows_of for k, i in enumerate(ev_rows_of[ph])}
    z_of: dict[str, dict[int, torch.Tensor]] = {ph: {} for ph in phases}
    pos_ids = torch.arange(n_pos, device=device)
    for l in layers:
        in_layer = {ph: (heads // g.n_heads == l) for ph, (heads, _) in pool_t.items()}
        union = sorted({int(h) % g.n_heads for ph, (heads, _) in pool_t.items()
                        for h in heads[in_layer[ph]].tolist()})
        keys = layer_keys(g.layers[l], g, hidden[l], union, pos_ids)
        for ph, idx in rows_of.items():
            heads, weights = pool_t[ph]
            local = (heads[in_layer[ph]] % g.n_heads).to(device)
            if local.numel() == 0:
                continue
            w = weights[in_layer[ph]].to(device)
            if ev_rows_of[ph]:
                z_of[ph][l] = torch.zeros(len(ev_rows_of[ph]), local.numel(), g.d_head, device=device)
            for s in range(0, len(idx), row_chunk):
                chunk = torch.tensor(idx[s:s + row_chunk], dtype=torch.long, device=device)
                probs = keys.rows(positions.index_select(0, chunk), local)  # [row, h, pos]
                a = torch.einsum("rhp,h->rp", probs, w)
                bmap = torch.stack([maps[rows[i].bucket_map_key] for i in chunk.tolist()])
                pooled.index_add_(0, chunk, torch.zeros(chunk.numel(), n_buckets, device=device)
                                  .scatter_add_(1, bmap, a))
                ev_local = [k for k, i in enumerate(chunk.tolist()) if rows[i].event_index is not None]
                if ev_local:
                    sel = torch.tensor(ev_local, dtype=torch.long, device=device)
                    z = keys.outputs(probs.index_select(0, sel), local)
                    slots = torch.tensor([slot[int(chunk[k])] for k in ev_local], device=device)
                    z_of[ph][l][slots] = z

    # m and c per event
    n_ev = len(events)
    m = torch.zeros(n_ev, dtype=torch.float32, device=device)
    c = torch.zeros(n_ev, dtype=torch.float32, device=device)
    margins = torch.zeros(n_ev, dtype=torch.float32, device=device)
    if n_ev:
        ev_rows = torch.tensor(event_row, dtype=torch.long, device=device)
        m = region_mass(pooled.index_select(0, ev_rows), [events[e].region for e in range(n_ev)])
        for ph, ev_idx_rows in ev_rows_of.items():
            if not ev_idx_rows:
                continue
            evs = [rows[i].event_index for i in ev_idx_rows]
            resid = final.index_select(0, positions[torch.tensor(ev_idx_rows, device=device)])
            logits = g.lm_head(g.final_norm(resid)).float()  # [e, vocab]
            targets = torch.tensor([events[e].target_id for e in evs], device=device)
            comps = [list(events[e].competitor_ids) for e in evs]
            width = max(len(cc) for cc in comps)
            padded = torch.tensor([cc + [-1] * (width - len(cc)) for cc in comps], device=device)
            mg = margin_of(logits, targets, padded)
            comp_logits = [logits[k, torch.tensor(cc, device=device)] for k, cc in enumerate(comps)]
            heads, weights = pool_t[ph]
            layer_of = heads // g.n_heads
            heads_by = {l: (heads[layer_of == l] % g.n_heads) for l in z_of[ph]}
            weights_by = {l: weights[layer_of == l] for l in z_of[ph]}
            cc_ph = contribution(z_of[ph], heads_by, weights_by, g, resid, targets, comps, comp_logits, mg)
            out_idx = torch.tensor(evs, device=device)
            c[out_idx] = cc_ph
            margins[out_idx] = mg.float()

    def np_(t: torch.Tensor) -> np.ndarray:
        return t.detach().cpu().numpy()

    return {
        "top_ids": np_(top_ids), "top_logp": np_(top_logp),
        "rows_pos": np_(positions), "rows_phase": np.array([r.phase for r in rows], dtype=str),
        "pooled": np_(pooled), "m": np_(m).astype(np.float32), "c": np_(c), "margin": np_(margins),
        "event_row": np.asarray(event_row, dtype=np.int64), "trace_start": np.asarray(trace_start, dtype=np.int64),
    }


def targets_manifest(targets: Mapping[str, Any]) -> dict[str, Any]:
    """What may be logged of one note's targets for any corpus: each array's name, shape, dtype
    and the sha256 of its bytes (C order), no values. ``top_ids`` / ``top_logp`` are the
    teacher's distribution at every trace position (its top-1 ids largely spell the trace), so
    for a restricted corpus the arrays stay local and only this manifest is uploaded."""
    out = {}
    for name in sorted(targets):
        a = np.ascontiguousarray(np.asarray(targets[name]))
        out[name] = {"shape": list(a.shape), "dtype": a.dtype.str,
                     "sha256": hashlib.sha256(a.tobytes()).hexdigest()}
    return {"arrays": out}


def save_targets(path: str | os.PathLike, targets: Mapping[str, Any]) -> Path:
    """Write one note's targets as a compressed ``.npz`` (atomic: temp file then rename)."""
    missing = [k for k in TARGET_KEYS if k not in targets]
    if missing:
        raise MistillInputError(f"targets lack {missing}", file=str(path), field=missing[0])
    arrays = {k: np.asarray(v) for k, v in targets.items()}
    if any(a.dtype == object for a in arrays.values()):
        raise MistillInputError("targets must be plain numeric or string arrays", file=str(path),
                                field="targets")
    with atomic_open(path, "wb") as fh:
        np.savez_compressed(fh, **arrays)
    return Path(path)


def load_targets(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Read targets written by :func:`save_targets` (no pickles)."""
    p = Path(path)
    if not p.is_file():
        raise MistillInputError("no teacher targets here", file=str(p), field="targets")
    try:
        with np.load(p, allow_pickle=False) as data:
            out = {k: data[k] for k in data.files}
    except (OSError, ValueError) as exc:
        raise MistillInputError(f"unreadable targets ({exc})", file=str(p), field="targets") from None
    missing = [k for k in TARGET_KEYS if k not in out]
    if missing:
        raise MistillInputError(f"targets lack {missing}", file=str(p), field=missing[0])
    return out
