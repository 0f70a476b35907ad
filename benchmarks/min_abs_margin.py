"""What the near-tie guard ``ArmConfig.min_abs_margin`` does on the embedded default.

``c(e)``, the pooled heads' direct-path contribution, is divided by the event's margin, so an
event whose teacher or student margin is near zero can make the interaction term
``(m_S c_S - m_T c_T)^2`` large. The guard leaves events with ``|margin| < min_abs_margin`` (nats)
out of the interaction and write terms. This script measures, on the embedded default (the real
SmolLM2-135M as teacher, its every-other-layer copy as student, synthetic notes):

1. per phase (P1, P2, P2C), how many supervised events a threshold of 0.5 nats drops (teacher
   margin, student margin at the note's first visit, either), the smallest margins seen, exact
   ties, and the teacher's ``c`` of the kept and of the dropped events;
2. a few optimizer steps of the Mistill arm (attention + interaction, bf16 weights, AdamW at the
   recipe's settings, clip 1) with the guard at 0.5 and at 0, from the same untrained student:
   per step the interaction term of each phase, the norm of the interaction terms' own gradient
   (``sum_P lambda_P L_int,P``) and of the whole loss's, before clipping, finite or not;
3. what margins of 0, 1e-6 and 1e-3 do to ``c`` (the division's edge).

The teacher's and the student's head pools are drawn from random importances (as the
objective's tests do), not from a calibrated ranking: the question is the margins' behaviour,
which the pools do not change. The notes are short synthetic notes (4-6 codes, a 40-code
inventory, no shortlist; ~1.5k tokens).

CPU cost: about a minute per note for the targets and two per optimizer step (the defaults,
3 notes and 3 steps per setting, took 16 minutes on two cores shared with other work; less
on an idle machine). Prints one JSON document (``--out`` writes it too).
Usage: python benchmarks/min_abs_margin.py [--notes 3] [--steps 3] [--out min_abs_margin.json]

``--smoke``: the same measurements for 1 note and 1 step per setting, with tiny Qwen3 models
(:data:`SMOKE_TEACHER`, :data:`SMOKE_STUDENT`, the embedded tokenizer) in place of SmolLM2 and its
copy, a 20-code inventory, and pools of at most as many heads as the model has: seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mistill.distill.objective as objective  # noqa: E402
from mistill.data.synthetic import make_synthetic_corpus  # noqa: E402
from mistill.distill.arms import resolve_arm  # noqa: E402
from mistill.distill.note_data import build_note_data  # noqa: E402
from mistill.distill.objective import compute_note_targets, micro_step_loss, pair_rows  # noqa: E402
from mistill.distill.pools import model_pools  # noqa: E402
from mistill.distill.trainer import RecipeConfig, prepare_student  # noqa: E402
from mistill.instrument.calibration import NoteImportance, calibrate, head_sets_json  # noqa: E402
from mistill.instrument.events import extract_events  # noqa: E402
from mistill.models.loading import EMBEDDED_DEFAULT, LoadedModel, load_model  # noqa: E402
from mistill.distill.attention_rows import contribution
from mistill.models.loading import tiny_model

STUDENT = "embedded:smollm2-135m@every-other"
SMOKE_TEACHER = "tiny:qwen3:layers=4:heads=8:kv=2"
SMOKE_STUDENT = "tiny:qwen3:seed=1:layers=2:heads=8:kv=2"
THRESHOLD = 0.5
PHASES = ("P1", "P2")  # the loss's phases: Phase 2 holds the P2 and P2C events


def random_head_sets(lm: LoadedModel, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    kinds = np.array(["P1"] * 6 + ["P2"] * 6 + ["P2C"] * 6 + ["NULL"] * 6)
    notes = [NoteImportance(note_id=f"n{i}", patient_id=f"p{i}", kinds=kinds,
                            importance=rng.normal(size=(kinds.size, lm.geometry.n_total_heads)).astype(np.float32))
             for i in range(8)]
    return head_sets_json(calibrate(notes, seed=0), lm.geometry.head_names())


@contextlib.contextmanager
def captured():
    """Record, inside ``micro_step_loss``, each phase's interaction term (with its graph) and the
    margins the event filter sees (the objective's own module functions, wrapped)."""
    rec: dict = {"interaction": [], "filter": []}
    real_int, real_filter = objective.interaction_term, objective.event_filter

    def interaction(m_s, c_s, m_t, c_t):
        out = real_int(m_s, c_s, m_t, c_t)
        rec["interaction"].append(out)
        return out

    def event_filter(t_margin, s_margin, c_t, min_abs_margin):
        rec["filter"].append((t_margin.detach().cpu().numpy(), s_margin.detach().cpu().numpy(),
                              c_t.detach().cpu().numpy()))
        return real_filter(t_margin, s_margin, c_t, min_abs_margin)
    objective.interaction_term, objective.event_filter = interaction, event_filter
    try:
        yield rec
    finally:
        objective.interaction_term, objective.event_filter = real_int, real_filter


def _finite_max(x: np.ndarray) -> float | None:
    x = np.abs(x[np.isfinite(x)])
    return float(x.max()) if x.size else None


def drop_counts(seen: dict[str, list]) -> dict:
    """Per phase: events, and those under the threshold by teacher / student / either margin,
    from the margins the filter saw on the first visit of each note."""
    out = {}
    for phase in PHASES:
        parts = seen.get(phase, [])
        t_m, s_m, c_t = (np.concatenate([p[i] for p in parts]) if parts else np.zeros(0) for i in range(3))
        t_low, s_low = np.abs(t_m) < THRESHOLD, np.abs(s_m) < THRESHOLD
        drop = t_low | s_low
        out[phase] = {
            "events": int(t_m.size), "dropped_teacher": int(t_low.sum()), "dropped_student": int(s_low.sum()),
            "dropped": int(drop.sum()), "dropped_share": float(drop.mean()) if t_m.size else None,
            "min_abs_teacher_margin": float(np.abs(t_m).min()) if t_m.size else None,
            "min_abs_student_margin": float(np.abs(s_m).min()) if s_m.size else None,
            "exact_zero_margins": int(((t_m == 0) | (s_m == 0)).sum()),
            "max_abs_c_teacher_kept": _finite_max(c_t[~drop]),
            "max_abs_c_teacher_dropped": _finite_max(c_t[drop]),
            "median_abs_c_teacher_kept": float(np.median(np.abs(c_t[~drop]))) if (~drop).any() else None,
            "nonfinite_c_teacher": int((~np.isfinite(c_t)).sum()),
        }
    return out


def _norm(gs) -> float:
    return float(torch.sqrt(sum((g.double() ** 2).sum() for g in gs if g is not None)))


def train_steps(examples, pools_s, steps: int, min_abs_margin: float, device: str,
                student: str = STUDENT) -> tuple[list[dict], dict]:
    """``steps`` optimizer steps (one note each, in turn) of the Mistill arm with the guard at
    ``min_abs_margin``: per step the interaction terms, the norm of the interaction terms' own
    gradient (``sum_P lambda_P L_int,P``) and of the whole loss's, before clipping. Also returns
    the margins the event filter saw on each note's first visit, by phase."""
    lm = load_model(student, dtype="float32", device=device)
    recipe = RecipeConfig(precision="bf16", grad_accum=1)
    model = prepare_student(lm.model, recipe)
    arm = resolve_arm("mistill", {"min_abs_margin": str(min_abs_margin)})
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=recipe.lr, betas=(recipe.beta1, recipe.beta2), weight_decay=0.0)
    log, seen, visited = [], {}, set()
    for step in range(steps):
        ex = examples[step % len(examples)]
        with captured() as rec:
            loss, parts = micro_step_loss(model, lm, ex["student"], ex["targets"], ex["pairing"], pools_s, arm)
        phases = [p for p in PHASES if f"{p}/interaction" in parts]
        # the interaction terms in phase order (a phase without event rows computes none); Phase 2's
        # per-kind diagnostics, computed last and without a graph, fall off the end of the zip
        int_total = sum(arm.lambdas[p] * t for p, t in zip(phases, rec["interaction"]))
        g_int = torch.autograd.grad(int_total, params, retain_graph=True, allow_unused=True)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        full_norm, int_norm = _norm(p.grad for p in params), _norm(g_int)
        if ex["id"] not in visited:
            visited.add(ex["id"])
            for p, f in zip(phases, rec["filter"]):
                seen.setdefault(p, []).append(f)
        log.append({"step": step, "note": ex["id"], "loss": parts["loss"],
                    **{f"{p}/interaction": parts.get(f"{p}/interaction") for p in PHASES},
                    "grad_norm": full_norm, "interaction_grad_norm": int_norm,
                    "finite": bool(math.isfinite(parts["loss"]) and math.isfinite(full_norm))})
        torch.nn.utils.clip_grad_norm_(params, recipe.clip)
        opt.step()
        print(f"min_abs_margin={min_abs_margin} step {step}: {log[-1]}", file=sys.stderr, flush=True)
    return log, seen


def tied_margin_probe() -> dict:
    """``c`` at margins 0, 1e-6, 1e-3: the division's edge (what the guard keeps out)."""
    lm = tiny_model("qwen3", layers=1, heads=2, kv_heads=1, d_head=8, d_model=16, seed=0)
    g = lm.geometry
    torch.manual_seed(0)
    z = {0: torch.randn(3, 1, g.d_head)}
    resid = torch.randn(3, g.d_model)
    comp = torch.tensor([[5], [6], [7]])
    comp_logits = torch.randn(3, 1)
    margins = torch.tensor([0.0, 1e-6, 1e-3])
    c = contribution(z, {0: torch.tensor([0])}, {0: torch.tensor([1.0])}, g, resid,
                     torch.tensor([1, 2, 3]), comp, comp_logits, margins)
    return {"margins": margins.tolist(), "c": [float(x) for x in c.detach()]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--notes", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per setting, one note each")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="")
    ap.add_argument("--smoke", action="store_true", help="tiny models, 1 note, 1 step per setting: seconds")
    args = ap.parse_args()
    teacher_spec, student_spec = EMBEDDED_DEFAULT, STUDENT
    if args.smoke:
        args.notes, args.steps, teacher_spec, student_spec = 1, 1, SMOKE_TEACHER, SMOKE_STUDENT
    torch.manual_seed(0)
    t0 = time.time()
    # short synthetic notes (4-6 codes, a 40-code inventory): ~1.5k tokens each
    corpus = make_synthetic_corpus(n_notes=args.notes, seed=0, n_codes_range=(4, 6),
                                   inventory_size=20 if args.smoke else 40)
    teacher = load_model(teacher_spec, dtype="float32", device=args.device)
    student_tok = load_model(student_spec, dtype="float32", device="cpu")
    pools_t = model_pools(random_head_sets(teacher, 0), teacher.geometry.head_names(),
                          k=min(40, teacher.geometry.n_total_heads))
    pools_s = model_pools(random_head_sets(student_tok, 1), student_tok.geometry.head_names(),
                          k=min(40, student_tok.geometry.n_total_heads))
    codes = list(corpus.inventory.codes)
    examples = []
    for note in corpus.notes[:args.notes]:
        events = extract_events(note.note_id, note.teacher_trace, codes, tokenizer=teacher.tokenizer, n_null=4)
        nd_t = build_note_data(note, corpus.inventory, teacher.tokenizer, events)
        targets = compute_note_targets(teacher, nd_t, pools_t, window=8)
        nd_s = build_note_data(note, corpus.inventory, student_tok.tokenizer, events)
        pairing = pair_rows(nd_s, nd_t.realized.values(), targets, window=8, teacher_trace_start=nd_t.trace_start)
        examples.append({"id": note.note_id, "student": nd_s, "targets": targets, "pairing": pairing,
                         "tokens": int(nd_s.input_ids.numel())})
    del teacher, student_tok
    print(f"targets: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    summary = {"teacher": teacher_spec, "student": student_spec, "precision": "bf16", "threshold": THRESHOLD,
               "notes": len(examples), "tokens_per_note": [ex["tokens"] for ex in examples],
               "tied_margin_probe": tied_margin_probe()}
    runs = {}
    for thr in (THRESHOLD, 0.0):
        log, seen = train_steps(examples, pools_s, args.steps, thr, args.device, student_spec)
        runs[str(thr)] = log
        if thr == THRESHOLD:
            summary["dropped_at_0.5"] = drop_counts(seen)
    summary["steps"] = runs
    summary["summary"] = {
        thr: {"all_finite": all(r["finite"] for r in log),
              "max_interaction": max((abs(r[f"{p}/interaction"]) for r in log for p in PHASES
                                      if r[f"{p}/interaction"] is not None), default=None),
              "max_interaction_grad_norm": max(r["interaction_grad_norm"] for r in log),
              "max_grad_norm": max(r["grad_norm"] for r in log)}
        for thr, log in runs.items()}
    summary["seconds"] = round(time.time() - t0, 1)
    text = json.dumps(summary, indent=2, default=float)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
