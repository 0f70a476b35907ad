"""Profile one single-row forward and one 256-variant forward of the prefix runner (device tool).

Prints the top operators by CUDA and by CPU time, to see whether a forward is bound by the
kernels or by the host; ``--out`` writes each forward's wall time as JSON. Usage:
    python benchmarks/profile_forward.py --model qwen3-4b --tokens 30000 [--out profile.json]

``--smoke``: the same forwards on a tiny Qwen3 (``bench_instrument.SMOKE_ARCH``, float32) on the CPU,
a 700-token note and 16 variants (one per head), profiled on the CPU alone: seconds.
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

from bench_instrument import build, card, sync  # noqa: E402

from mistill.instrument.hooks import HeadHook  # noqa: E402
from mistill.instrument.passes import prefill_note  # noqa: E402
from mistill.instrument.patching import Query, clean_read, mean_ablate  # noqa: E402
from mistill.instrument.runner import Runner  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-4b")
    ap.add_argument("--tokens", type=int, default=30000)
    ap.add_argument("--variants", type=int, default=256)
    ap.add_argument("--out", default="")
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU: seconds")
    args = ap.parse_args()
    device, dtype = "cuda", torch.bfloat16
    if args.smoke:
        args.model, args.tokens, args.variants, device, dtype = "smoke", 700, 16, "cpu", torch.float32
    lm = build(args.model, max_pos=max(args.tokens + 1024, 40960), dtype=dtype, device=device)
    g = lm.geometry
    runner = Runner(lm, chunk_size=4096)
    hook = HeadHook(g)
    ids = torch.randint(0, min(150000, g.vocab), (args.tokens,))
    prefix, mean = prefill_note(runner, hook, ids)
    pos = args.tokens - min(500, args.tokens // 4)
    q = Query(position=pos, token_id=int(ids[pos]), target_id=1000, competitor_ids=tuple(range(1001, 1025)))
    prefix.crop(pos)
    clean = clean_read(runner, hook, prefix, q)
    variants = [[h % g.n_total_heads] for h in range(args.variants)]
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    res: dict = {"model": args.model, "tokens": args.tokens, "card": card(args.smoke)}
    for name, fn in [("single", lambda: clean_read(runner, hook, prefix, q)),
                     (f"variants{args.variants}", lambda: mean_ablate(runner, hook, prefix, q, variants, mean,
                                                                      hidden_in=clean.hidden_in))]:
        fn()
        sync()
        t = time.perf_counter()
        fn()
        sync()
        res[f"{name}_wall_s"] = time.perf_counter() - t
        print(name, "wall", res[f"{name}_wall_s"])
        with torch.profiler.profile(activities=activities) as prof:
            fn()
            sync()
        if device == "cuda":
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
