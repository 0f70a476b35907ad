"""Device benchmark of the read side and the edits (App. E) on a random-init real architecture.

For one note of Qwen3-14B at 106k tokens (bf16, one GPU):

1. the plain prefill every pass makes (:meth:`Runner.prefill`) against ``read_side``'s whole
   capture: the same prefill, then each panel head's causal row at 150 event positions from the
   prefix's keys (:func:`~mistill.instrument.readside.prefix_attention_rows`): time and peak
   memory (goal: at most 1.2x the prefill, memory flat in prompt length);
2. the edit re-feed (:func:`~mistill.instrument.edits.refeed_margins`): the identity and three
   replacements re-fed from the edit against the note's prefix, each read twice (plain and with
   two heads mean-ablated at the decision), at several re-feed lengths: edited reads per second
   (goal: at least 20);
3. key-side blocking (:func:`~mistill.instrument.keyblock.key_block`): the reference, the named
   and the control key sets of one head at an event, one forward from the head's layer.

Usage: python benchmarks/bench_readside.py --model qwen3-14b --tokens 106000 --out readside.json
(torch + transformers only). ``--smoke``: all three parts (not ``--parts``) on a tiny Qwen3
(``bench_instrument.SMOKE_ARCH``, float32) on the CPU, an 800-token note, 8 events, 8 panel heads,
re-feeds of 16 and 32 tokens: seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_instrument import ARCHS  # noqa: E402
from bench_instrument import build as build_model  # noqa: E402

from mistill.instrument.edits import refeed_margins  # noqa: E402
from mistill.instrument.hooks import HeadHook  # noqa: E402
from mistill.instrument.keyblock import key_block  # noqa: E402
from mistill.instrument.passes import prefill_note  # noqa: E402
from mistill.instrument.patching import Query, clean_read, mean_ablate  # noqa: E402
from mistill.instrument.readside import prefix_attention_rows  # noqa: E402
from mistill.instrument.runner import Runner  # noqa: E402
from mistill.models.loading import LoadedModel  # noqa: E402


def build(name: str, max_pos: int, device: str, layers: int | None) -> LoadedModel:
    """``bench_instrument.build`` in bf16 on CUDA, in float32 elsewhere."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return build_model(name, max_pos, layers=layers, dtype=dtype, device=device)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def peak_start(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: str) -> float:
    return torch.cuda.max_memory_allocated() / 2 ** 30 if device == "cuda" else float("nan")


def clock(fn, device: str, reps: int = 1):
    """Mean seconds of ``reps`` calls after one warm-up call, and the last result."""
    fn()
    sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        out = fn()
    sync(device)
    return (time.perf_counter() - t) / reps, out


def read_side(args, runner: Runner, lm: LoadedModel, ids: torch.Tensor, positions: list[int], panel: list[int],
              res: dict) -> None:
    """The plain prefill against the read side's whole capture (part 1)."""
    dev = args.device
    peak_start(dev)
    res["prefill_s"], _ = clock(lambda: runner.prefill(ids)[0].length, dev)
    res["prefill_peak_gib"] = peak_gib(dev)
    peak_start(dev)
    res["read_side_s"], rows = clock(lambda: prefix_attention_rows(runner, runner.prefill(ids)[0], positions, panel),
                                     dev)
    res["read_side_peak_gib"] = peak_gib(dev)
    res["read_side_over_prefill"] = res["read_side_s"] / res["prefill_s"]
    res["rows_sum_max_error"] = float((rows.sum(-1) - 1).abs().max())
    del rows
    print(json.dumps(res), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-14b", choices=sorted(ARCHS))
    ap.add_argument("--tokens", type=int, default=106000)
    ap.add_argument("--events", type=int, default=150)
    ap.add_argument("--panel", type=int, default=64, help="panel heads (the paper: 3 x 16 top, 16 random)")
    ap.add_argument("--refeed", default="256,1024,4096", help="re-feed lengths of the edits")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--only-edits", action="store_true", help="skip part 1")
    ap.add_argument("--parts", action="store_true", help="also time the parts of an edit's re-feed")
    ap.add_argument("--out", default="readside.json")
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU: seconds")
    args = ap.parse_args()
    if args.smoke:
        args.model, args.tokens, args.events, args.panel, args.refeed = "smoke", 800, 8, 8, "16,32"
        args.device, args.chunk = "cpu", 512
    dev = args.device
    lm = build(args.model, args.tokens + 16, dev, args.layers)
    g = lm.geometry
    gen = torch.Generator().manual_seed(0)
    vocab = min(150000, g.vocab)
    ids = torch.randint(0, vocab, (args.tokens,), generator=gen)
    # the events sit in the trace: the last 30% of the input
    positions = sorted(torch.randint(int(args.tokens * 0.7), args.tokens - 1, (args.events,), generator=gen).tolist())
    panel = sorted(torch.randperm(g.n_total_heads, generator=gen)[:args.panel].tolist())
    res: dict = {"model": args.model, "tokens": args.tokens, "events": args.events, "panel_heads": len(panel),
                 "card": torch.cuda.get_device_name() if dev == "cuda" else "cpu"}
    runner, hook = Runner(lm, chunk_size=args.chunk), HeadHook(g)

    # 1. the plain prefill against the read side's capture
    if not args.only_edits:
        read_side(args, runner, lm, ids, positions, panel, res)

    # 2. edits re-fed against the note's prefix; 3. key blocking at one event
    peak_start(dev)
    prefix, mean = prefill_note(runner, hook, ids)
    q_pos = positions[-1]
    query = Query(position=q_pos, token_id=int(ids[q_pos]), target_id=11, competitor_ids=(12, 13, 14))
    mediation = [g.n_total_heads - 1, g.n_total_heads // 2]
    for length in (int(x) for x in args.refeed.split(",")):
        start = q_pos + 1 - length
        variants = ids[start:q_pos + 1].repeat(4, 1)
        variants[1:, :3] = torch.randint(0, vocab, (3, 3), generator=gen)  # three replacements at the edit
        secs, _ = clock(lambda v=variants, s=start: refeed_margins(runner, hook, prefix, s, v, query, mean=mean,
                                                                     heads=mediation), dev, reps=3)
        res[f"edit_refeed{length}_s"] = secs
        res[f"edit_refeed{length}_reads_per_s"] = 2 * variants.shape[0] / secs
    # correctness on the card: the identity read against the clean read, the ablated read
    # against mean-ablation at the decision (both bf16 paths of other kernel shapes)
    length = int(args.refeed.split(",")[0])
    plain, ablated = refeed_margins(runner, hook, prefix, q_pos + 1 - length, ids[None, q_pos + 1 - length:q_pos + 1],
                                    query, mean=mean, heads=mediation)
    res["edit_identity_minus_clean"] = float(plain[0]) - clean_read(runner, hook, prefix, query).margin
    res["edit_ablated_minus_mean_ablate"] = float(ablated[0]) - float(
        mean_ablate(runner, hook, prefix, query, [mediation], mean)[0])
    res["clean_margin"] = clean_read(runner, hook, prefix, query).margin
    if args.parts:
        # how the batched re-feed scales with the variants per forward, at the first re-feed length,
        # and, per prefix kernel, a run of events of different lengths, each timed once (a kernel
        # that plans per shape pays for it here)
        length = int(args.refeed.split(",")[0])
        start = q_pos + 1 - length
        for k in (1, 2, 4, 8, 16):
            variants = ids[start:q_pos + 1].repeat(k, 1)
            res[f"part_variants{k}_s"], _ = clock(lambda v=variants, s=start: refeed_margins(
                runner, hook, prefix, s, v, query, mean=mean, heads=mediation), dev, reps=3)
        for kernel in ("split", "auto"):
            runner.prefill_kernel = kernel
            sync(dev)
            t = time.perf_counter()
            for n in range(length - 8, length + 8):
                refeed_margins(runner, hook, prefix, q_pos + 1 - n, ids[q_pos + 1 - n:q_pos + 1].repeat(4, 1), query,
                               mean=mean, heads=mediation)
            sync(dev)
            res[f"part_16_events_{kernel}_reads_per_s"] = 16 * 8 / (time.perf_counter() - t)
        runner.prefill_kernel = "auto"
        print(json.dumps(res), flush=True)
    clean = clean_read(runner, hook, prefix, query)
    head = g.n_heads * (g.n_layers // 2) + 1
    # 300 key positions each, from 100 and from 1,000 (scaled down where the note is short)
    span, named_from, control_from = min(300, q_pos // 4), min(100, q_pos // 8), min(1000, q_pos // 2)
    named = list(range(named_from, named_from + span))
    control = list(range(control_from, control_from + span))
    secs, _ = clock(lambda: key_block(runner, hook, prefix, query, clean.hidden_in, head, [[], named, control]),
                    dev, reps=5)
    res["key_block_event_s"] = secs
    res["edits_peak_gib"] = peak_gib(dev)
    print(json.dumps(res), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
