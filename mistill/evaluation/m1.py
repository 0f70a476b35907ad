"""M1 and teacher-trace perplexity: teacher-forced readouts of any model on the teacher's traces.

M1 (App. K): at the teacher's decision events (P1, P2, P2C), realized in the evaluated model's
own tokenizer with the instrument's anchor rule, the model's margin ``logit(target) -
logsumexp(logits(competitors))``; reported per event kind as ``p_pos`` = P(margin > 0) and the
median margin, per note and over all events of a corpus.

Teacher-trace perplexity: ``exp`` of the mean next-token negative log-likelihood over the trace
tokens of prompt + teacher trace (the median over notes is the fidelity figure).

Both read the same teacher-forced forward: :func:`teacher_forced_readouts` runs it once and
computes both from its final hidden states (each function alone runs its own).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from mistill.instrument.events import margin
from mistill.models.loading import LoadedModel
from mistill.instrument.inputs import NoteInput, phase_events

M1_KINDS = ("P1", "P2", "P2C")


def note_margins(lm: LoadedModel, ni: NoteInput, codes: Sequence[str],
                 hidden: torch.Tensor | None = None, task=None) -> list[dict]:
    """One row per realized P1/P2/P2C event of the note's teacher trace: ``event_id, kind, margin``.

    ni: the note's prompt + teacher trace in ``lm``'s tokenizer (:func:`mistill.instrument.inputs.note_input`).
    hidden: ``[pos, d_model]`` final hidden states of ``ni.input_ids`` (:func:`final_hidden`),
    computed here when None.
    Events that the tokenizer cannot realize (no single-token target) are dropped, as in the
    instrument; the coverage is the caller's to count. ``task``: the label space
    (:func:`mistill.tasks.task_for`; default ICD-10-CM).
    """
    realized = [r for r in phase_events(ni, codes, lm.tokenizer, task=task) if r.event.kind in M1_KINDS]
    if not realized:
        return []
    if hidden is None:
        hidden = final_hidden(lm, ni.input_ids)
    logits = _logits_at(lm, hidden, [r.position for r in realized])
    return [{"event_id": r.event.event_id, "kind": r.event.kind,
             "margin": float(margin(logits[i], r.target_id, list(r.competitor_ids)))}
            for i, r in enumerate(realized)]


def m1_summary(rows: Iterable[dict]) -> dict[str, float]:
    """Metrics ``m1/<kind>/p_pos``, ``m1/<kind>/median_margin`` and ``m1/<kind>/n`` over the rows
    given."""
    by_kind: dict[str, list[float]] = {}
    for r in rows:
        by_kind.setdefault(r["kind"], []).append(float(r["margin"]))
    out: dict[str, float] = {}
    for kind in M1_KINDS:
        m = np.asarray(by_kind.get(kind, []), dtype=np.float64)
        out[f"m1/{kind}/n"] = float(m.size)
        if m.size:
            out[f"m1/{kind}/p_pos"] = float((m > 0).mean())
            out[f"m1/{kind}/median_margin"] = float(np.median(m))
    return out


def teacher_forced_readouts(lm: LoadedModel, ni: NoteInput, codes: Sequence[str],
                            trace_start: int, *, task=None) -> tuple[float, list[dict]]:
    """Teacher-trace perplexity and the M1 rows of one note from a single forward of
    ``ni.input_ids``: ``(trace_perplexity(...), note_margins(...))``."""
    hidden = final_hidden(lm, ni.input_ids)
    return (trace_perplexity(lm, ni.input_ids, trace_start, hidden=hidden),
            note_margins(lm, ni, codes, hidden=hidden, task=task))


@torch.no_grad()
def final_hidden(lm: LoadedModel, input_ids: torch.Tensor) -> torch.Tensor:
    """Final hidden states ``[pos, d_model]`` of one teacher-forced forward of ``input_ids`` ``[pos]``."""
    device = next(lm.model.parameters()).device
    was = lm.model.training
    lm.model.eval()
    hidden = lm.model.model(input_ids=input_ids.to(device).unsqueeze(0), use_cache=False).last_hidden_state[0]
    lm.model.train(was)
    return hidden


@torch.no_grad()
def _logits_at(lm: LoadedModel, hidden: torch.Tensor, positions: Sequence[int]) -> torch.Tensor:
    """Next-token logits ``[row, vocab]`` (float32) at ``positions`` from final hidden states
    ``[pos, d_model]``."""
    idx = torch.as_tensor(list(positions), dtype=torch.long, device=hidden.device)
    return lm.geometry.lm_head(hidden.index_select(0, idx)).float()


@torch.no_grad()
def trace_perplexity(lm: LoadedModel, input_ids: torch.Tensor, trace_start: int, *, chunk: int = 1024,
                     hidden: torch.Tensor | None = None) -> float:
    """``exp(mean NLL)`` of the trace tokens ``input_ids[trace_start:]`` given everything before them.

    input_ids: ``[pos]``; hidden: their final hidden states ``[pos, d_model]``
    (:func:`final_hidden`), computed here when None; logits are computed ``chunk`` rows at a time
    (never ``[pos, vocab]`` at once).
    """
    n = int(input_ids.numel())
    if not 0 < trace_start < n:
        raise ValueError(f"trace_start {trace_start} outside 1..{n - 1}")
    if hidden is None:
        hidden = final_hidden(lm, input_ids)
    targets = input_ids.to(hidden.device)
    total = 0.0
    for s in range(trace_start - 1, n - 1, chunk):
        e = min(n - 1, s + chunk)
        logits = lm.geometry.lm_head(hidden[s:e]).float()
        total += float(torch.nn.functional.cross_entropy(logits, targets[s + 1:e + 1], reduction="sum"))
    return float(np.exp(total / (n - trace_start)))
