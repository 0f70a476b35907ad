"""Device benchmark of the prefill and the attribution pass at Qwen3-14B @ 106k (one GPU).

Where a note's prefill spends its time, and what a different attention kernel gives:

1. attention alone, one layer of the 14B geometry (40 query heads, 8 KV heads, d_head 128),
   summed over the chunks of a 106k-token prefill (x 40 layers = the prefill's attention):
   ``split`` (the prefix through flash with the query heads folded per KV head, the chunk's own
   causal block apart, merged through the log-sum-exp in float32), ``one_kernel`` (one causal
   flash call over prefix + chunk, lower-right aligned, the KV heads as they are),
   ``cudnn_prefix`` (the split path with cuDNN's kernel for the prefix part), and the floor of
   one unchunked causal call over the whole sequence (flash and cuDNN);
2. the model's prefill (random-init Qwen3-14B, bf16), the split path against one kernel, with
   the difference of their prefixes and logits at 64 positions;
3. the whole attribution pass of ``bench_instrument.py`` (150 events) with the faster prefill.

4. (``--mode chunks``) the ``cudnn`` prefill at several chunk sizes and the attribution
   pass at ``--chunk``; (``--mode profile``) that prefill's GPU time by kernel.

Usage: python benchmarks/bench_prefill.py --mode kernels|prefill|chunks --out prefill.json (torch + transformers only)

``--smoke``: every mode in turn (each one's results under its name) on a tiny Qwen3
(``bench_instrument.SMOKE_ARCH``, float32) on the CPU, a 1,024-token note in chunks of 256 and 512,
10 events: seconds. The CPU has neither the flash nor the cuDNN kernel: the runner's kernel
choices all take the math path there, the attention-alone kernels it lacks are recorded as errors,
and the profile's ``gpu`` keys hold the CPU's time by operator.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_instrument import build, card, empty_cache, peak_gib, reset_peak, sync, timed  # noqa: E402

from mistill.instrument.hooks import HeadHook  # noqa: E402
from mistill.instrument.passes import AttributionConfig, EventQuery, attribute_note  # noqa: E402
from mistill.instrument.patching import Query  # noqa: E402
from mistill.instrument import runner as runner_mod  # noqa: E402
from mistill.instrument.runner import Runner, causal_over_prefix  # noqa: E402
from mistill.instrument.passes import exact_sweep, first_order_sweep


MODES = ("kernels", "prefill", "chunks", "profile")


def clock(fn) -> tuple[float, object]:
    """One timed call after a warm-up call."""
    return timed(fn, reps=1)


def cudnn_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """The prefix part through cuDNN's fused attention: ``out`` and ``lse`` (float32)."""
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), None,
                                                             True, 0.0, False, False, scale=scale)
    return res[0][0].float(), res[1][0].reshape(q.shape[0], q.shape[1]).float()


def attention_alone(tokens: int, chunk: int, heads: int = 40, kv: int = 8, d: int = 128, *,
                    device: str = "cuda") -> dict:
    """Per-layer attention time of a chunked prefill, by kernel, and their differences."""
    g = heads // kv
    scale = d ** -0.5
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    K = torch.randn(1, kv, tokens, d, device=device, dtype=dtype, generator=gen)
    V = torch.randn(1, kv, tokens, d, device=device, dtype=dtype, generator=gen)
    Q = torch.randn(1, heads, tokens, d, device=device, dtype=dtype, generator=gen)
    fake = SimpleNamespace(use_flash=None)
    starts = list(range(0, tokens, chunk))
    out: dict = {}

    def split(start: int, end: int, prefix_fn=None):
        q, k_new, v_new = Q[:, :, start:end], K[:, :, start:end], V[:, :, start:end]
        if prefix_fn is None:
            return Runner._attend(fake, q, k_new, v_new, K[0, :, :start], V[0, :, :start], scale, "causal")
        saved = runner_mod.prefix_attention
        runner_mod.prefix_attention = lambda qf, kp, vp, sc, **kw: prefix_fn(qf, kp, vp, sc)
        try:
            return Runner._attend(fake, q, k_new, v_new, K[0, :, :start], V[0, :, :start], scale, "causal")
        finally:
            runner_mod.prefix_attention = saved

    def one(start: int, end: int):
        return causal_over_prefix(Q[:, :, start:end], K[:, :, :end], V[:, :, :end], scale)

    variants = {"split": lambda s, e: split(s, e), "one_kernel": one,
                "cudnn_prefix": lambda s, e: split(s, e, cudnn_prefix)}
    last = {}
    for name, fn in variants.items():
        try:
            total = 0.0
            for s in starts:
                e = min(tokens, s + chunk)
                if s == 0:
                    fn(s, e)  # the first chunk has no prefix: the same fused call in every variant
                t, res = clock(lambda: fn(s, e))
                total += t
            last[name] = res.float()
            out[f"attn_layer_{name}_s"] = total
        except Exception as err:  # noqa: BLE001  (a kernel the build lacks, or another signature)
            out[f"attn_layer_{name}_error"] = str(err)[:200]
    for name in last:
        if name != "split":
            out[f"attn_{name}_vs_split_max_abs"] = (last[name] - last["split"]).abs().max().item()
    kr, vr = K.repeat_interleave(g, dim=1), V.repeat_interleave(g, dim=1)
    try:
        t, _ = clock(lambda: torch.ops.aten._scaled_dot_product_flash_attention(Q, kr, vr, 0.0, True, False,
                                                                                scale=scale))
        out["attn_layer_unchunked_flash_s"] = t
    except Exception as err:  # noqa: BLE001  (no flash kernel: the CPU)
        out["attn_layer_unchunked_flash_error"] = str(err)[:200]
    try:
        t, _ = clock(lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(Q, kr, vr, None, False, 0.0, True,
                                                                                False, scale=scale))
        out["attn_layer_unchunked_cudnn_s"] = t
    except Exception as err:  # noqa: BLE001
        out["attn_layer_unchunked_cudnn_error"] = str(err)[:200]
    flops = 4 * (tokens * tokens / 2) * d * heads
    for key in [k for k in out if k.startswith("attn_layer_") and k.endswith("_s")]:
        out["attn_tflops_" + key[len("attn_layer_"):-len("_s")]] = flops / out[key] / 1e12
    out["gqa_flash_native"] = bool(runner_mod.GQA_FLASH)
    K = V = Q = kr = vr = None  # free the inputs before the model is built
    empty_cache()
    return out


def events_for(ids: torch.Tensor, tokens: int, n_ev: int = 150) -> list[EventQuery]:
    letters = list(range(1000, 1025))
    rng = np.random.default_rng(2)
    trace = min(6000, tokens // 2)
    positions = np.sort(rng.choice(np.arange(tokens - trace, tokens - 1), size=n_ev, replace=False))
    kinds = (["P1"] * 20 + ["P2"] * 60 + ["P2C"] * 30 + ["NULL"] * (n_ev - 110))[:n_ev]
    rng.shuffle(kinds)
    return [EventQuery(event_id=f"e{i}", kind=k,
                       query=Query(position=int(p), token_id=int(ids[p]), target_id=letters[i % 25],
                                   competitor_ids=tuple(x for x in letters if x != letters[i % 25])))
            for i, (p, k) in enumerate(zip(positions, kinds))]


def probe_positions(tokens: int) -> torch.Tensor:
    """64 positions, 90 apart, ending at the note's end (closer where the note is short)."""
    step = min(90, tokens // 64)
    return torch.arange(tokens - 64 * step, tokens, step)


def kernels_in_model(args) -> dict:
    """The split prefill against one flash call per chunk, and the pass with the latter."""
    res: dict = {}
    lm = build(args.model, max_pos=args.tokens + 1024, dtype=args.dtype, device=args.device)
    runner, hook = Runner(lm, chunk_size=args.chunk), HeadHook(lm.geometry)
    ids = torch.randint(0, min(150000, lm.geometry.vocab), (args.tokens,), generator=torch.Generator().manual_seed(1))
    probe = probe_positions(args.tokens)
    kept = {}
    for label, kernel in (("split", "split"), ("one_kernel", "flash")):
        runner.prefill_kernel = kernel
        runner.prefill(ids[:4096])  # warm-up
        reset_peak()
        sync()
        t = time.perf_counter()
        with hook.accumulate_mean() as acc:
            prefix, logits = runner.prefill(ids, logits_at=probe)
        sync()
        res[f"prefill_{label}_s"] = time.perf_counter() - t
        res[f"prefill_{label}_peak_gib"] = peak_gib()
        kept[label] = (logits, prefix.keys[-1][0, :, -512:].float(), acc.mean.float())
        del prefix
        empty_cache()
    res["prefill_logits_max_abs_diff"] = (kept["split"][0] - kept["one_kernel"][0]).abs().max().item()
    res["prefill_logits_max_abs"] = kept["split"][0].abs().max().item()
    res["prefill_last_layer_keys_max_abs_diff"] = (kept["split"][1] - kept["one_kernel"][1]).abs().max().item()
    res["prefill_head_means_max_abs_diff"] = (kept["split"][2] - kept["one_kernel"][2]).abs().max().item()
    res["prefill_argmax_agree"] = float((kept["split"][0].argmax(-1) == kept["one_kernel"][0].argmax(-1)).float().mean())
    events = events_for(ids, args.tokens, args.events)
    runner.prefill_kernel = "flash"
    reset_peak()
    sync()
    t = time.perf_counter()
    att = attribute_note(runner, hook, "bench", ids, events, AttributionConfig(chunk_size=args.chunk),
                         running_global=list(range(16)), progress=False)
    sync()
    res["pass_one_kernel_s"] = time.perf_counter() - t
    res["pass_one_kernel_peak_gib"] = peak_gib()
    res["pass_one_kernel_exact_patches"] = int((~np.isnan(att.exact)).sum())
    return res


def timed_prefill(runner: Runner, hook: HeadHook, ids: torch.Tensor,
                  probe: torch.Tensor) -> tuple[float, float, torch.Tensor]:
    """One prefill of ``ids`` with the head-mean hook, after a warm-up of two chunks: seconds,
    peak GiB and the logits at ``probe``."""
    runner.prefill(ids[:2 * min(runner.chunk_size, 8192)])  # warm-up, a prefix included
    reset_peak()
    sync()
    t = time.perf_counter()
    with hook.accumulate_mean():
        prefix, logits = runner.prefill(ids, logits_at=probe)
    sync()
    took = time.perf_counter() - t
    del prefix
    peak = peak_gib()
    empty_cache()
    return took, peak, logits


def timed_pass(runner: Runner, hook: HeadHook, ids: torch.Tensor, tokens: int, chunk: int, n_ev: int = 150) -> dict:
    """The attribution pass (150 events, 16 running global heads) timed in its parts: the
    first-order sweep with the prefill, the exact sweep; peak memory and exact patches."""
    events = events_for(ids, tokens, n_ev)
    cfg = AttributionConfig(chunk_size=chunk)
    reset_peak()
    sync()
    t0 = time.perf_counter()
    sweep = first_order_sweep(runner, hook, "bench", ids, events, cfg, progress=False)
    sync()
    t1 = time.perf_counter()
    att = exact_sweep(runner, hook, sweep, cfg, list(range(16)), progress=False)
    sync()
    t2 = time.perf_counter()
    return {"pass_s": t2 - t0, "pass_first_order_sweep_s": t1 - t0,  # the prefill included
            "pass_exact_sweep_s": t2 - t1, "pass_peak_gib": peak_gib(),
            "pass_exact_patches": int((~np.isnan(att.exact)).sum()),
            "pass_exact_events": int((~np.isnan(att.exact)).any(axis=1).sum())}


def prefill_and_pass(args) -> dict:
    """The model's prefill by kernel (``Runner.prefill_kernel``; the logits at 64 positions
    against the split path's), then the attribution pass with the default (``auto``), timed in
    its parts."""

    res: dict = {}
    lm = build(args.model, max_pos=args.tokens + 1024, dtype=args.dtype, device=args.device)
    runner, hook = Runner(lm, chunk_size=args.chunk), HeadHook(lm.geometry)
    ids = torch.randint(0, min(150000, lm.geometry.vocab), (args.tokens,), generator=torch.Generator().manual_seed(1))
    probe = probe_positions(args.tokens)
    ref = None
    for kernel in ("split", "flash", "cudnn"):
        runner.prefill_kernel = kernel
        res[f"prefill_{kernel}_s"], res[f"prefill_{kernel}_peak_gib"], logits = timed_prefill(runner, hook, ids, probe)
        if ref is None:
            ref = logits
        else:
            res[f"prefill_{kernel}_logits_max_abs_diff"] = (logits - ref).abs().max().item()
            res[f"prefill_{kernel}_argmax_agree"] = float((logits.argmax(-1) == ref.argmax(-1)).float().mean())
        print(json.dumps(res), flush=True)
    runner.prefill_kernel = "auto"
    res["cudnn_prefix_usable"] = bool(runner_mod.cudnn_prefix_usable(ref.to(torch.bfloat16)))
    res.update(timed_pass(runner, hook, ids, args.tokens, args.chunk, args.events))
    return res


def chunk_sizes(args) -> dict:
    """The ``cudnn`` prefill (prefix and the chunk's own causal block through cuDNN) at several
    chunk sizes, its logits at 64 positions against one flash call per 8,192-token chunk, then
    the attribution pass (prefill ``auto``) at ``--chunk``."""

    res: dict = {}
    lm = build(args.model, max_pos=args.tokens + 1024, dtype=args.dtype, device=args.device)
    hook = HeadHook(lm.geometry)
    ids = torch.randint(0, min(150000, lm.geometry.vocab), (args.tokens,), generator=torch.Generator().manual_seed(1))
    probe = probe_positions(args.tokens)

    runner = Runner(lm, chunk_size=8192)
    runner.prefill_kernel = "flash"
    res["prefill_flash_c8192_s"], res["prefill_flash_c8192_peak_gib"], ref = timed_prefill(runner, hook, ids, probe)
    res["cudnn_prefix_usable"] = bool(runner_mod.cudnn_prefix_usable(ref.to(torch.bfloat16)))
    for chunk in args.chunks:
        runner = Runner(lm, chunk_size=chunk)
        runner.prefill_kernel = "cudnn"
        runner.fuse_elementwise = args.fuse
        took, peak, logits = timed_prefill(runner, hook, ids, probe)
        res[f"prefill_cudnn_c{chunk}_s"], res[f"prefill_cudnn_c{chunk}_peak_gib"] = took, peak
        res[f"prefill_cudnn_c{chunk}_logits_max_abs_diff"] = (logits - ref).abs().max().item()
        res[f"prefill_cudnn_c{chunk}_argmax_agree"] = float((logits.argmax(-1) == ref.argmax(-1)).float().mean())
        print(json.dumps(res), flush=True)
    best = args.chunk
    res["pass_chunk"] = best
    runner = Runner(lm, chunk_size=best)
    runner.fuse_elementwise = args.fuse
    res["fuse_elementwise"] = args.fuse
    res.update(timed_pass(runner, hook, ids, args.tokens, best, args.events))
    return res


def profile(args) -> dict:
    """The ``cudnn`` prefill at ``--chunk`` under torch's profiler: time, and the GPU time by kernel
    (the top 30), to see where a prefill's time goes."""
    from torch.profiler import ProfilerActivity  # deferred: torch.profiler is slow to import
    from torch.profiler import profile as torch_profile  # deferred: torch.profiler is slow to import

    lm = build(args.model, max_pos=args.tokens + 1024, dtype=args.dtype, device=args.device)
    hook = HeadHook(lm.geometry)
    runner = Runner(lm, chunk_size=args.chunk)
    runner.prefill_kernel = "cudnn"
    ids = torch.randint(0, min(150000, lm.geometry.vocab), (args.tokens,), generator=torch.Generator().manual_seed(1))
    runner.prefill(ids[:2 * min(args.chunk, 8192)])  # warm-up
    sync()
    t = time.perf_counter()
    with hook.accumulate_mean():
        prefix = runner.prefill(ids)[0]
    sync()
    res: dict = {"prefill_cudnn_s": time.perf_counter() - t}
    del prefix
    empty_cache()
    # the GPU's time by kernel; without CUDA, the CPU's by operator under the same keys
    activity, own = ((ProfilerActivity.CUDA, "self_device_time_total") if torch.cuda.is_available()
                     else (ProfilerActivity.CPU, "self_cpu_time_total"))
    with torch_profile(activities=[activity]) as prof, hook.accumulate_mean():
        runner.prefill(ids)
        sync()
    res["gpu_total_s"] = sum(getattr(e, own) for e in prof.key_averages()) / 1e6
    res["top"] = [{"name": e.key[:120], "calls": e.count, "self_gpu_s": getattr(e, own) / 1e6}
                  for e in sorted(prof.key_averages(), key=lambda e: -getattr(e, own))[:30]]
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-14b")
    ap.add_argument("--tokens", type=int, default=106000)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--events", type=int, default=150, help="events of the attribution pass")
    ap.add_argument("--mode", choices=MODES, default="prefill")
    ap.add_argument("--chunks", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--fuse", action="store_true",
                    help="the norms and rotary embedding compiled (Runner.fuse_elementwise)")
    ap.add_argument("--out", default="bench_prefill.json")
    ap.add_argument("--smoke", action="store_true", help="every mode on a tiny model on the CPU: seconds")
    args = ap.parse_args()
    args.device, args.dtype = "cuda", torch.bfloat16
    if args.smoke:
        args.model, args.tokens, args.chunk, args.chunks, args.events = "smoke", 1024, 256, [256, 512], 10
        args.device, args.dtype = "cpu", torch.float32
    res: dict = {"model": args.model, "tokens": args.tokens, "chunk": args.chunk,
                 "card": card(args.smoke), "torch": torch.__version__}
    if args.smoke:
        for mode in MODES:
            res[mode] = run_mode(mode, args)
    else:
        res.update(run_mode(args.mode, args))
    print(json.dumps(res, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))


def run_mode(mode: str, args) -> dict:
    if mode == "kernels":
        if args.smoke:  # one KV head of the 14B layer's (five query heads each)
            return {**attention_alone(args.tokens, args.chunk, heads=5, kv=1, device=args.device),
                    **kernels_in_model(args)}
        return {**attention_alone(args.tokens, args.chunk), **kernels_in_model(args)}
    if mode == "chunks":
        return chunk_sizes(args)
    if mode == "profile":
        return profile(args)
    return prefill_and_pass(args)


if __name__ == "__main__":
    main()
