"""Profile one single-row forward and one 256-variant forward of the prefix runner (device tool).

Prints the top operators by CUDA and by CPU time, to see whether a forward is bound by the
kernels or by the host. Usage: python benchmarks/profile_forward.py --model qwen3-4b --tokens 30000
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_instrument import build  # noqa: E402

from mistill.instrument.hooks import HeadHook  # noqa: E402
from mistill.instrument.passes import prefill_note  # noqa: E402
from mistill.instrument.patching import Query, clean_read, mean_ablate  # noqa: E402
from mistill.instrument.runner import Runner  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-4b")
    ap.add_argument("--tokens", type=int, default=30000)
    args = ap.parse_args()
    lm = build(args.model, max_pos=max(args.tokens + 1024, 40960))
    g = lm.geometry
    runner = Runner(lm, chunk_size=4096)
    hook = HeadHook(g)
    ids = torch.randint(0, 150000, (args.tokens,))
    prefix, mean = prefill_note(runner, hook, ids)
    pos = args.tokens - 500
    q = Query(position=pos, token_id=int(ids[pos]), target_id=1000, competitor_ids=tuple(range(1001, 1025)))
    prefix.crop(pos)
    clean = clean_read(runner, hook, prefix, q)
    variants = [[h] for h in range(256)]
    for name, fn in [("single", lambda: clean_read(runner, hook, prefix, q)),
                     ("variants256", lambda: mean_ablate(runner, hook, prefix, q, variants, mean,
                                                         hidden_in=clean.hidden_in))]:
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        print(name, "wall", time.perf_counter() - t)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
