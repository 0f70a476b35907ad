"""Device benchmark of the attribution pass over several GPUs: the same per-note numbers as one
GPU, and the throughput (notes in waves, :mod:`mistill.instrument.waves`).

Random-init Qwen3-4B (or 14B) at the paper's prompt length, ``--notes`` notes of random tokens
with 150 events each (as ``bench_instrument.py``), the running global ranking from the notes
before each (App. C). Every rank times the whole pass between two barriers; rank 0 gathers every
note's arrays and writes them with the timing. ``--compare`` reads two such outputs (one GPU,
several) and reports the largest differences and the speed-up.

Usage (one device call, from the repository root)::

    python benchmarks/bench_scaling.py --out $OUT/w1 && \\
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_scaling.py --out $OUT/w2 && \\
    python benchmarks/bench_scaling.py --compare $OUT/w1 $OUT/w2 > $OUT/scaling.json

``--smoke``: a tiny model on CPU processes (gloo), to check the script. Needs torch and
transformers only (no MLflow).
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

from mistill.distributed import barrier, gather, init_world  # noqa: E402
from mistill.instrument.hooks import HeadHook  # noqa: E402
from mistill.instrument.passes import AttributionConfig, EventQuery, running_global_top  # noqa: E402
from mistill.instrument.patching import Query  # noqa: E402
from mistill.instrument.runner import Runner  # noqa: E402
from mistill.instrument.waves import attribute_waves  # noqa: E402
from mistill.models.loading import tiny_model

ARRAYS = ("first_order", "exact", "margins")


def note_inputs(note: int, tokens: int, n_events: int, vocab: int) -> tuple[torch.Tensor, list[EventQuery]]:
    """A note of random tokens and its events in the last sixth of it (the trace)."""
    ids = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(100 + note))
    rng = np.random.default_rng(note)
    trace = max(tokens // 6, n_events + 1)
    positions = np.sort(rng.choice(np.arange(tokens - trace, tokens - 1), size=n_events, replace=False))
    kinds = (["P1"] * 20 + ["P2"] * 60 + ["P2C"] * 30 + ["NULL"] * max(0, n_events - 110))[:n_events]
    rng.shuffle(kinds)
    letters = list(range(1000, 1025))
    return ids, [EventQuery(event_id=f"n{note}:e{i}", kind=k,
                            query=Query(position=int(p), token_id=int(ids[p]), target_id=letters[i % 25],
                                        competitor_ids=tuple(x for x in letters if x != letters[i % 25])))
                 for i, (p, k) in enumerate(zip(positions, kinds))]


def run(args) -> None:
    device = "cpu" if args.smoke else "cuda"
    world = init_world(device)
    if args.smoke:
        lm = tiny_model("qwen3", layers=2, heads=4, kv_heads=2, d_head=16, d_model=64, seed=1)
    else:
        from bench_instrument import build  # deferred: bench_instrument only when needed

        lm = build(args.model, max_pos=args.tokens + 1024)  # on this rank's GPU (init_world set it)
    runner, hook = Runner(lm, chunk_size=args.chunk), HeadHook(lm.geometry)
    cfg = AttributionConfig(chunk_size=args.chunk)
    vocab = min(lm.geometry.vocab, 150000)
    inputs = {f"note{n:03d}": note_inputs(n, args.tokens, args.events, vocab) for n in range(args.notes)}
    order = list(inputs)

    def running(means: dict) -> list[int]:
        return running_global_top(means.get("P1", []), 16)

    warm_ids, warm_events = note_inputs(999, min(args.tokens, 4096), min(args.events, 20), vocab)
    list(attribute_waves(runner, hook, ["warm"], {}, lambda _: (warm_ids, warm_events), cfg, running,
                         type(world)(), progress=False))  # this rank alone: kernels and allocator
    if not args.smoke:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    barrier(world)
    t0 = time.perf_counter()
    mine = {a.note_id: {k: getattr(a, k) for k in ARRAYS}
            for a in attribute_waves(runner, hook, order, {}, inputs.__getitem__, cfg, running, world, progress=False)}
    if not args.smoke:
        torch.cuda.synchronize()
    barrier(world)
    elapsed = time.perf_counter() - t0
    peak = 0.0 if args.smoke else torch.cuda.max_memory_allocated() / 2 ** 30
    parts = gather((mine, peak), world)
    if not world.leader:
        return
    notes = {k: v for part, _ in parts for k, v in part.items()}
    assert sorted(notes) == order, "a note is missing from the gathered results"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / "notes.npz", **{f"{n}.{k}": notes[n][k] for n in order for k in ARRAYS})
    res = {"world_size": world.size, "model": "tiny" if args.smoke else args.model, "tokens": args.tokens,
           "notes": args.notes, "events": args.events, "pass_s": elapsed, "notes_per_s": args.notes / elapsed,
           "peak_gib_max_over_ranks": max(p for _, p in parts),
           "card": "cpu-smoke" if args.smoke else torch.cuda.get_device_name()}
    (out / "timing.json").write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))


def compare(one: Path, many: Path) -> dict:
    a, b = np.load(one / "notes.npz"), np.load(many / "notes.npz")
    ta, tb = (json.loads((p / "timing.json").read_text()) for p in (one, many))
    assert sorted(a.files) == sorted(b.files), "the two runs measured different notes"
    res: dict = {"world_sizes": [ta["world_size"], tb["world_size"]], "card": tb["card"], "notes": tb["notes"]}
    for k in ARRAYS:
        keys = [f for f in a.files if f.endswith("." + k)]
        diff = max(float(np.nanmax(np.abs(a[f] - b[f]))) if np.isfinite(a[f]).any() else 0.0 for f in keys)
        res[f"{k}_max_abs_diff"] = diff
        res[f"{k}_identical"] = all(np.array_equal(a[f], b[f], equal_nan=True) for f in keys)
        res[f"{k}_nan_pattern_same"] = all(np.array_equal(np.isnan(a[f]), np.isnan(b[f])) for f in keys)
    res.update({"pass_s_one": ta["pass_s"], "pass_s_many": tb["pass_s"], "speedup": ta["pass_s"] / tb["pass_s"],
                "peak_gib_one": ta["peak_gib_max_over_ranks"], "peak_gib_many": tb["peak_gib_max_over_ranks"]})
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-4b")
    ap.add_argument("--tokens", type=int, default=30000)
    ap.add_argument("--notes", type=int, default=16)
    ap.add_argument("--events", type=int, default=150)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--out", default="bench_scaling")
    args = run_or_compare(ap, compare)
    if args is not None:
        if args.smoke:
            args.tokens, args.events, args.chunk = min(args.tokens, 400), min(args.events, 24), min(args.chunk, 128)
        run(args)


def run_or_compare(ap: argparse.ArgumentParser, compare_fn) -> argparse.Namespace | None:
    """Add ``--smoke`` and ``--compare ONE MANY`` to a multi-GPU benchmark's parser; print the
    comparison and return None when asked for one, else return the parsed arguments."""
    ap.add_argument("--smoke", action="store_true", help="tiny model, CPU processes (gloo)")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("ONE", "MANY"))
    args = ap.parse_args()
    if args.compare:
        print(json.dumps(compare_fn(*args.compare), indent=2))
        return None
    return args


if __name__ == "__main__":
    main()
