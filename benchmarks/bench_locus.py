"""Device benchmark of the locus pass (App. F) on a random-init real architecture (bf16, one GPU).

Measures, for Qwen3-14B at 106k tokens (or Qwen3-4B at 30k), on one note whose trace is the last
``--trace`` tokens and which has ``--mentions`` chapter mentions:
- the prefill (with the per-head means) and the prefix size;
- forcing-probe throughput: many cuts as rows of shared forwards against the one prefix
  (:func:`mistill.instrument.locus.forced_margins`), at several probes per forward; the same
  with the shared-keys split turned off (every key on the masked math path), to show what the
  split buys;
- the walk-back of every mention (:func:`mistill.instrument.locus.locate_many`): probes, rounds,
  time;
- window attribution (64 window rows + the suffix, graph intact, one backward) per mention;
- pass A (12 exact variants per mention) and pass B (10 per mention) with
  :func:`mistill.instrument.window.ablate_at`; follow-through (4 sets x 2) per window mention;
- the whole note: probes + window attribution + passes A/B (the goal: <= 20 s after the
  prefill for 20 mentions), and the NULL windows (20 per note) beside it;
- correctness on the card (before the output layer is scaled): probe rows batched vs one probe
  per forward, and the shared-keys split vs the masked math path, max abs margin difference
  (bf16 rounding); window attribution with the flash kernel under gradients vs the exact float32
  math path (time, Pearson, max abs difference);
- peak GPU memory.

Random weights give random margins: the output layer is scaled (``--logit-scale``), each
mention's target is the letter the model prefers at the code token, and theta is the median of
those margins (so walks take several rounds, as on a trained model). The tied embeddings of
Qwen3-4B are scaled with it (the inputs then differ; the cost does not). Usage:
    python benchmarks/bench_locus.py --model qwen3-14b --tokens 106000 --out raw.json
Needs torch + transformers only (no MLflow).

``--smoke``: every measurement and check above on a tiny Qwen3 (``bench_instrument.SMOKE_ARCH``,
float32, 16 heads) on the CPU: a 700-token note, 3 mentions, windows of 16 rows: seconds. The CPU
has no flash kernel, so the "flash" figures there are the math path; the masked-only runs still
swap :func:`~mistill.instrument.runner.prefix_attention` as on the card.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mistill.instrument.runner as runner_module  # noqa: E402
from bench_instrument import build, card, peak_gib, reset_peak, sync  # noqa: E402
from mistill.instrument.hooks import HeadHook  # noqa: E402
from mistill.instrument.locus import ForcedChoice, LocusConfig, MentionProbe, forced_margins, locate_many  # noqa: E402
from mistill.instrument.passes import prefill_note  # noqa: E402
from mistill.instrument.runner import Runner  # noqa: E402
from mistill.instrument.window import ablate_at, follow_through, window_attribution  # noqa: E402

LETTERS = list(range(1000, 1025))   # 25 chapter-letter token ids
SUFFIX = torch.tensor([2000, 2001, 2002, 2003, 2004, 2005])  # a 6-token forcing suffix


def _elapsed(fn):
    sync()
    t = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - t, out


def _masked_only(fn):
    """Run ``fn`` with the shared-keys split off: every key of a probe on the masked math path."""
    real = runner_module.prefix_attention

    def masked(q, k, v, scale, *, use_flash=None, row_limit=None, kernel="flash"):
        if row_limit is None:
            return real(q, k, v, scale, use_flash=use_flash, kernel=kernel)
        return runner_module._MathPrefixAttention.apply(q, k, v, scale, row_limit)

    runner_module.prefix_attention = masked
    try:
        return fn()
    finally:
        runner_module.prefix_attention = real


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-14b")
    ap.add_argument("--tokens", type=int, default=106000)
    ap.add_argument("--trace", type=int, default=6000)
    ap.add_argument("--mentions", type=int, default=20)
    ap.add_argument("--nulls", type=int, default=20)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--logit-scale", type=float, default=64.0)
    ap.add_argument("--out", default="bench_locus.json")
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU: seconds")
    args = ap.parse_args()
    device, dtype = "cuda", torch.bfloat16
    if args.smoke:
        args.model, args.tokens, args.trace, args.mentions, args.nulls = "smoke", 700, 300, 3, 2
        args.chunk, args.width, device, dtype = 512, 16, "cpu", torch.float32

    lm = build(args.model, max_pos=max(args.tokens + 1024, 40960), dtype=dtype, device=device)
    g = lm.geometry
    runner, hook = Runner(lm, chunk_size=args.chunk), HeadHook(g)
    ids = torch.randint(0, min(150000, g.vocab), (args.tokens,),
                        generator=torch.Generator().manual_seed(1))
    res: dict = {"model": args.model, "tokens": args.tokens, "trace_tokens": args.trace, "mentions": args.mentions,
                 "card": card(args.smoke), "torch": torch.__version__}
    reset_peak()
    res["prefill_s"], (prefix, mean) = _elapsed(lambda: prefill_note(runner, hook, ids))
    res["kv_prefix_gib"] = prefix.nbytes / 2 ** 30
    res["prefill_peak_gib"] = peak_gib()

    trace_start = args.tokens - args.trace
    rng = np.random.default_rng(0)
    first = trace_start + min(600, args.trace // 2)  # the mentions sit past the trace's start
    qs = np.sort(rng.choice(np.arange(first, args.tokens - 2), size=args.mentions, replace=False)).tolist()

    # correctness on the card, before the output layer is scaled (bf16 rounding of plain logits)
    base = ForcedChoice(LETTERS[0], tuple(LETTERS[1:]))
    check_cuts = [q - d for q in qs[:4] for d in (0, 8, 16, 40)]
    batched = forced_margins(runner, prefix, check_cuts, SUFFIX, base, batch_size=64)
    masked = _masked_only(lambda: forced_margins(runner, prefix, check_cuts, SUFFIX, base, batch_size=64))
    single = torch.stack([forced_margins(runner, prefix, [c], SUFFIX, base, batch_size=1)[0] for c in check_cuts])
    res["check_split_vs_masked_math_max_abs_nats"] = (batched - masked).abs().max().item()
    res["check_batched_vs_single_probe_max_abs_nats"] = (batched - single).abs().max().item()
    res["check_mean_abs_forced_margin"] = batched.abs().mean().item()
    locus = qs[0] - 5
    window_attribution(runner, hook, prefix, ids, locus, SUFFIX, base.target_id, base.competitor_ids, mean,
                       width=args.width)  # warm-up
    t_flash, wa_flash = _elapsed(lambda: window_attribution(runner, hook, prefix, ids, locus, SUFFIX, base.target_id,
                                                            base.competitor_ids, mean, width=args.width))
    runner.use_flash = False
    t_math, wa_math = _elapsed(lambda: window_attribution(runner, hook, prefix, ids, locus, SUFFIX, base.target_id,
                                                          base.competitor_ids, mean, width=args.width))
    runner.use_flash = None
    a, b = wa_flash.importance.flatten().double(), wa_math.importance.flatten().double()
    res["window_attribution_s_flash_grad"] = t_flash
    res["window_attribution_s_math_path"] = t_math
    res["check_window_attribution_flash_vs_math_pearson"] = float(torch.corrcoef(torch.stack([a, b]))[0, 1])
    res["check_window_attribution_flash_vs_math_max_abs"] = (a - b).abs().max().item()
    res["check_window_attribution_max_abs"] = b.abs().max().item()
    res["check_window_forced_margin_flash_vs_math_nats"] = abs(wa_flash.margin - wa_math.margin)

    with torch.no_grad():  # random weights: a sharper output layer so forced margins span several nats
        g.lm_head.weight.mul_(args.logit_scale)
    # each mention's target: the letter the model prefers at the code token (random weights)
    at_code = forced_margins(runner, prefix, [q for q in qs for _ in LETTERS], SUFFIX,
                             [ForcedChoice(t, tuple(x for x in LETTERS if x != t)) for t in LETTERS] * len(qs),
                             batch_size=128)
    best = at_code.view(len(qs), len(LETTERS)).argmax(1).tolist()
    choices = [ForcedChoice(LETTERS[b], tuple(x for x in LETTERS if x != LETTERS[b])) for b in best]
    margins0 = at_code.view(len(qs), len(LETTERS)).max(1).values
    theta = max(float(margins0.median()), 1e-3)
    res["theta_used"] = theta

    # probe throughput: 16 cuts per mention (two grid rounds' worth), several batch sizes
    cuts = [q - d for q in qs for d in range(0, 16 * 8, 8)]
    per_cut = [c for c in choices for _ in range(16)]
    reset_peak()
    for b in (64, 128, 320):
        forced_margins(runner, prefix, cuts[:b], SUFFIX, per_cut[:b], batch_size=b)  # warm-up
        t, _ = _elapsed(lambda: forced_margins(runner, prefix, cuts, SUFFIX, per_cut, batch_size=b))
        res[f"probes_per_s_batch{b}"] = len(cuts) / t
        res[f"probe_forward_s_batch{b}"] = t / -(-len(cuts) // b)
    res["probe_peak_gib"] = peak_gib()
    t, _ = _elapsed(lambda: _masked_only(lambda: forced_margins(runner, prefix, cuts, SUFFIX, per_cut, batch_size=64)))
    res["probes_per_s_batch64_masked_math_only"] = len(cuts) / t

    # the walk-back of every mention
    cfg = LocusConfig(theta=theta)
    mentions = [MentionProbe(q=q, choice=c, trace_start=trace_start, previous_code_end=q - 40)
                for q, c in zip(qs, choices)]
    res["walk_s"], walks = _elapsed(lambda: locate_many(runner, prefix, mentions, SUFFIX, cfg, batch_size=128))
    res["walk_probes"] = int(sum(w.n_probes for w in walks))
    res["walk_probes_per_s"] = res["walk_probes"] / res["walk_s"]
    res["walk_outcomes"] = {o: sum(1 for w in walks if w.outcome == o) for o in {w.outcome for w in walks}}
    loci = [w.locus if w.locus is not None else q - 1 for w, q in zip(walks, qs)]

    # window attribution, passes A and B, follow-through
    reset_peak()
    n_heads = g.n_total_heads
    top = rng.permutation(n_heads).tolist()
    t_wa = t_a = t_b = t_ft = 0.0
    for m, locus, c in zip(mentions, loci, choices):
        dt, wa = _elapsed(lambda: window_attribution(runner, hook, prefix, ids, locus, SUFFIX, c.target_id,
                                                     c.competitor_ids, mean, width=args.width))
        t_wa += dt
        own = torch.argsort(-wa.importance[:wa.n_window].sum(0)).tolist()
        variants_a = []
        for k in (8, 16):
            variants_a += [(top[:k], "both"), (own[:k], "both"), (rng.choice(n_heads, k, replace=False).tolist(), "both"),
                           (top[::-1][:k], "both")]
        variants_a += [(top[:16], "window"), (top[:16], "suffix"), (own[:16], "window"), (own[:16], "suffix")]
        dt, _ = _elapsed(lambda: ablate_at(runner, hook, prefix, ids, locus, SUFFIX, c.target_id, c.competitor_ids,
                                           mean, variants_a, width=args.width))
        t_a += dt
        variants_b = []
        for k in (8, 16):
            variants_b += [(top[:k], "window"), (top[:k], "suffix"), (top[:k], "both"),
                           (rng.choice(n_heads, k, replace=False).tolist(), "window"), (top[::-1][:k], "window")]
        dt, _ = _elapsed(lambda: ablate_at(runner, hook, prefix, ids, locus, SUFFIX, c.target_id, c.competitor_ids,
                                           mean, variants_b, width=args.width))
        t_b += dt
        sets = [[], top[:16], top[16:32], rng.choice(n_heads, 16, replace=False).tolist()]
        for sustained in (False, True):
            dt, _ = _elapsed(lambda: follow_through(runner, hook, prefix, ids, locus, m.q, c.target_id,
                                                    c.competitor_ids, mean, sets, sustained=sustained,
                                                    width=args.width))
            t_ft += dt
    res["window_attribution_s_per_mention"] = t_wa / len(qs)
    res["pass_a_s_per_mention"] = t_a / len(qs)
    res["pass_b_s_per_mention"] = t_b / len(qs)
    res["follow_through_s_per_mention"] = t_ft / len(qs)
    res["window_peak_gib"] = peak_gib()
    nulls = np.sort(rng.choice(np.arange(trace_start + 100, args.tokens - 2), size=args.nulls, replace=False)).tolist()
    t_null = 0.0
    for p in nulls:
        dt, _ = _elapsed(lambda: window_attribution(runner, hook, prefix, ids, p, SUFFIX, choices[0].target_id,
                                                    choices[0].competitor_ids, mean, width=args.width))
        t_null += dt
    res["null_windows_s"] = t_null
    res["note_s_probes_window_attribution_passes_ab"] = res["walk_s"] + t_wa + t_a + t_b
    res["note_s_with_null_windows_and_follow_through"] = res["note_s_probes_window_attribution_passes_ab"] + t_null + t_ft
    res["peak_gib"] = max(res["prefill_peak_gib"], res["probe_peak_gib"], peak_gib())
    print(json.dumps(res, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
