"""Device benchmark of the instrument on random-init real architectures (bf16, one GPU).

Measures, for Qwen3-14B at 106k tokens or Qwen3-4B at 30k tokens:
- prefill of the note (with the per-head mean accumulation) and the prefix size;
- exact patching throughput: B single-head mean-ablation variants per forward against the
  shared prefix, versus one variant per forward; correctness of the batched flash path against
  sequential patching on the exact math path, on a handful of variants;
- a whole attribution pass on one note with 150 events (prefill, first-order attribution at
  every event, exact patches of the nominees at P1 and half the NULL events);
- peak GPU memory of each.

Usage: python benchmarks/bench_instrument.py --model qwen3-14b --tokens 106000 --out results.json
Needs torch + transformers only (no MLflow).

``--smoke``: the same measurements and checks (the float32 ones included) on a tiny Qwen3
(:data:`SMOKE_ARCH`, float32) on the CPU, a 1,200-token note: seconds. The CPU has no flash kernel,
so every "flash" figure there is the math path, and the flash-vs-math kernel check is left out.
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

from mistill.instrument.attribution import first_order  # noqa: E402
from mistill.instrument.hooks import HeadHook  # noqa: E402
from mistill.instrument.passes import AttributionConfig, EventQuery, attribute_note, prefill_note  # noqa: E402
from mistill.instrument.patching import Query, clean_read, mean_ablate, sequential_patch  # noqa: E402
from mistill.instrument.runner import Runner  # noqa: E402
from mistill.models.geometry import head_geometry  # noqa: E402
from mistill.models.loading import LoadedModel  # noqa: E402
from mistill.instrument.patching import knock_in
from mistill.instrument.runner import prefix_attention

ARCHS = {
    "qwen3-14b": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40,
                      num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
}
SMOKE_ARCH = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=16, vocab_size=49152 + 64, tie_word_embeddings=True)
"""The benchmarks' ``--smoke`` architecture (name ``smoke``): a tiny Qwen3 for the CPU, with 16 heads
(enough for the benchmarks' 16-head sets) and the embedded tokenizer's vocabulary plus 64 entries."""


def build(name: str, max_pos: int, *, layers: int | None = None, dtype=torch.bfloat16,
          device: str = "cuda") -> LoadedModel:
    """A random-init model of ``name`` (``ARCHS``, or ``smoke``: :data:`SMOKE_ARCH`) on ``device``."""
    from transformers import AutoModelForCausalLM, Qwen3Config  # deferred: transformers is slow to import

    arch = dict(SMOKE_ARCH if name == "smoke" else ARCHS[name])
    if layers is not None:
        arch["num_hidden_layers"] = layers
    cfg = Qwen3Config(**arch, max_position_embeddings=max_pos, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.eval()
    return LoadedModel(model=model, tokenizer=None, geometry=head_geometry(model), spec=f"random:{name}")


def sync() -> None:
    """Wait for the GPU's queued work (nothing to wait for without CUDA)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float:
    """Peak GPU memory since :func:`reset_peak` (NaN without CUDA)."""
    return torch.cuda.max_memory_allocated() / 2 ** 30 if torch.cuda.is_available() else float("nan")


def empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def card(smoke: bool) -> str:
    return "cpu-smoke" if smoke else torch.cuda.get_device_name()


def timed(fn, reps: int = 3):
    fn()
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        out = fn()
    sync()
    return (time.perf_counter() - t) / reps, out


def fp32_checks(name: str, tokens: int, device: str = "cuda") -> dict:
    """Exactness of the batched paths where rounding cannot hide a bug: float32 weights.

    A 6-layer model of the architecture in float32 (math attention path): batched variants
    against one-variant-per-forward, knock-in of every head against the clean margin; and the
    flash kernel's output and log-sum-exp against the math path on bf16 inputs.
    """
    out: dict = {}
    lm = build(name, max_pos=max(tokens + 1024, 40960), layers=6, dtype=torch.float32, device=device)
    g = lm.geometry
    runner, hook = Runner(lm, chunk_size=8192), HeadHook(g)
    vocab = min(150000, g.vocab)
    ids = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(3))
    prefix, mean = prefill_note(runner, hook, ids)
    pos = tokens - 300
    q = Query(position=pos, token_id=int(ids[pos]), target_id=1000, competitor_ids=tuple(range(1001, 1025)))
    prefix.crop(pos)
    clean = clean_read(runner, hook, prefix, q)
    variants = [[h] for h in range(0, g.n_total_heads, 3)][:64] + [list(range(0, g.n_total_heads, 7))]
    batched = mean_ablate(runner, hook, prefix, q, variants, mean, hidden_in=clean.hidden_in, batch_size=32)
    n_seq = min(12, len(variants) - 1)
    seq = sequential_patch(runner, hook, prefix, q, variants[:n_seq] + variants[-1:], mean)
    out["fp32_batched_vs_sequential_max_abs_nats"] = (
        batched[list(range(n_seq)) + [len(variants) - 1]] - seq).abs().max().item()
    out["fp32_mean_abs_effect_nats"] = (clean.margin - batched).abs().mean().item()
    other = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(4))
    donor, _ = prefill_note(runner, hook, other)
    back = min(1000, pos // 2)
    donor.crop(pos - back)
    qd = Query(position=pos - back, token_id=q.token_id, target_id=q.target_id, competitor_ids=q.competitor_ids)
    m_all = knock_in(runner, hook, donor, qd, [list(range(g.n_total_heads))], clean.z)[0].item()
    out["fp32_knockin_all_heads_minus_clean_nats"] = m_all - clean.margin
    if device == "cuda":  # the flash kernel against the math path (no flash kernel on the CPU)
        qq = torch.randn(8, 1280, 128, device="cuda", dtype=torch.bfloat16)
        kk = torch.randn(8, tokens, 128, device="cuda", dtype=torch.bfloat16)
        vv = torch.randn(8, tokens, 128, device="cuda", dtype=torch.bfloat16)
        o_f, l_f = prefix_attention(qq, kk, vv, 128 ** -0.5, use_flash=True)
        o_m, l_m = prefix_attention(qq, kk, vv, 128 ** -0.5, use_flash=False)
        out["flash_vs_math_attention_out_max_abs"] = (o_f - o_m).abs().max().item()
        out["flash_vs_math_lse_max_abs"] = (l_f - l_m).abs().max().item()
    del lm, prefix, donor
    empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-4b", choices=sorted(ARCHS))
    ap.add_argument("--tokens", type=int, default=30000)
    ap.add_argument("--variants", type=int, default=256)
    ap.add_argument("--events", type=int, default=150)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--out", default="bench_instrument.json")
    ap.add_argument("--fp32-checks", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU (the float32 checks too): seconds")
    args = ap.parse_args()
    device, dtype = "cuda", torch.bfloat16
    if args.smoke:
        args.model, args.tokens, args.variants, args.events, args.chunk = "smoke", 1200, 8, 16, 512
        args.fp32_checks, device, dtype = True, "cpu", torch.float32
    checks = fp32_checks(args.model, min(args.tokens, 8000), device) if args.fp32_checks else {}

    lm = build(args.model, max_pos=max(args.tokens + 1024, 40960), dtype=dtype, device=device)
    g = lm.geometry
    runner = Runner(lm, chunk_size=args.chunk)
    hook = HeadHook(g)
    ids = torch.randint(0, min(150000, g.vocab), (args.tokens,), generator=torch.Generator().manual_seed(1))
    letters = list(range(1000, 1025))
    res: dict = {"model": args.model, "tokens": args.tokens, "card": card(args.smoke),
                 "torch": torch.__version__, **checks}

    reset_peak()
    sync()
    t = time.perf_counter()
    prefix, mean = prefill_note(runner, hook, ids)
    sync()
    res["prefill_s"] = time.perf_counter() - t
    res["kv_prefix_gib"] = prefix.nbytes / 2 ** 30
    res["prefill_peak_gib"] = peak_gib()

    pos = args.tokens - 500
    q = Query(position=pos, token_id=int(ids[pos]), target_id=letters[0], competitor_ids=tuple(letters[1:]))
    prefix.crop(pos)
    clean = clean_read(runner, hook, prefix, q)
    rng = np.random.default_rng(0)
    for n_var in sorted({args.variants, 2 * args.variants}):
        heads = rng.choice(g.n_total_heads, size=min(n_var, g.n_total_heads), replace=False).tolist()
        variants = [[h] for h in heads]
        reset_peak()
        t_batched, batched = timed(lambda: mean_ablate(runner, hook, prefix, q, variants, mean,
                                                       hidden_in=clean.hidden_in, batch_size=len(variants)))
        res[f"patches_per_s_batched_{len(variants)}"] = len(variants) / t_batched
        res[f"patch_forward_s_{len(variants)}"] = t_batched
        res[f"patch_peak_gib_{len(variants)}"] = peak_gib()
        t_nostart, _ = timed(lambda: mean_ablate(runner, hook, prefix, q, variants, mean, hidden_in=None,
                                                 batch_size=len(variants)))
        res[f"patches_per_s_batched_{len(variants)}_from_layer0"] = len(variants) / t_nostart
    # every head of the model, sorted by layer, in batches: the self-test's workload
    every = [[h] for h in range(g.n_total_heads)]
    t_all, _ = timed(lambda: mean_ablate(runner, hook, prefix, q, every, mean, hidden_in=clean.hidden_in,
                                         batch_size=args.variants), reps=1)
    res["patches_per_s_all_heads_sorted_by_layer"] = len(every) / t_all
    few = variants[:8]
    batched8 = batched[:8]
    t_seq, seq_flash = timed(lambda: sequential_patch(runner, hook, prefix, q, few, mean), reps=1)
    res["single_token_forward_s"] = t_seq / len(few)
    res["patches_per_s_sequential"] = len(few) / t_seq
    runner.use_flash = False
    seq_math = sequential_patch(runner, hook, prefix, q, few, mean)
    batched_math = mean_ablate(runner, hook, prefix, q, few, mean, hidden_in=clean.hidden_in)
    runner.use_flash = None
    res["check_batched_flash_vs_sequential_flash_max_abs_nats"] = (batched8 - seq_flash).abs().max().item()
    res["check_batched_math_vs_sequential_math_max_abs_nats"] = (batched_math - seq_math).abs().max().item()
    res["check_flash_vs_math_sequential_max_abs_nats"] = (seq_flash - seq_math).abs().max().item()
    res["check_mean_abs_single_head_effect_nats"] = (clean.margin - seq_math).abs().mean().item()
    res["check_clean_margin"] = clean.margin

    reset_peak()
    t_fo, _ = timed(lambda: first_order(runner, hook, prefix, q, mean), reps=3)
    res["forward_backward_one_position_s"] = t_fo
    res["forward_backward_peak_gib"] = peak_gib()
    del prefix
    empty_cache()

    # a whole attribution pass: 150 events in the last 6k tokens (the trace)
    n_ev = args.events
    ev_rng = np.random.default_rng(2)
    trace = min(6000, args.tokens // 2)
    positions = np.sort(ev_rng.choice(np.arange(args.tokens - trace, args.tokens - 1), size=n_ev, replace=False))
    kinds = (["P1"] * 20 + ["P2"] * 60 + ["P2C"] * 30 + ["NULL"] * (n_ev - 110))[:n_ev]
    ev_rng.shuffle(kinds)
    events = [EventQuery(event_id=f"e{i}", kind=k,
                         query=Query(position=int(p), token_id=int(ids[p]), target_id=letters[i % 25],
                                     competitor_ids=tuple(x for x in letters if x != letters[i % 25])))
              for i, (p, k) in enumerate(zip(positions, kinds))]
    cfg = AttributionConfig(chunk_size=args.chunk)
    reset_peak()
    sync()
    t = time.perf_counter()
    att = attribute_note(runner, hook, "bench", ids, events, cfg, running_global=list(range(16)), progress=False)
    sync()
    res["attribution_pass_s"] = time.perf_counter() - t
    res["attribution_pass_peak_gib"] = peak_gib()
    res["attribution_exact_patches"] = int((~np.isnan(att.exact)).sum())
    res["attribution_events"] = n_ev
    print(json.dumps(res, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
