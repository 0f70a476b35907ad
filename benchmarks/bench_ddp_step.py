"""Device benchmark of data-parallel training: one optimizer step of the recipe's global batch
(8 examples) through :class:`~mistill.distill.trainer.Trainer`, on one GPU or several.

The student and its targets are ``bench_train_step.py``'s (random-init Qwen3-4B, a ~30k-token
note). Each rank computes its share of the batch, the gradients are summed over the ranks
(float32 buckets for the bf16 arms' whole weights, FSDP's reduce-scatter for the fp32 arm's
shards), every rank steps. Per arm (Vanilla CoT-KD, Mistill): the optimizer
step's wall time after a warm-up step, samples/s and peak memory; ``--compare`` gives the
speed-up of the second output over the first.

Usage (one device call, from the repository root)::

    python benchmarks/bench_ddp_step.py --out $OUT/d1.json && \\
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_ddp_step.py --out $OUT/d2.json && \\
    python benchmarks/bench_ddp_step.py --compare $OUT/d1.json $OUT/d2.json

Needs what ``bench_train_step.py`` needs (the SmolLM2 tokenizer files, simple-icd-10-cm).
``--smoke``: a tiny model on CPU processes (gloo) with the embedded tokenizer.
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

from bench_scaling import run_or_compare  # noqa: E402
from bench_train_step import smoke_tokenizer, student_setup  # noqa: E402

from mistill.distill.arms import resolve_arm  # noqa: E402
from mistill.distill.objective import micro_step_loss  # noqa: E402
from mistill.distill.trainer import RecipeConfig, Trainer, prepare_student  # noqa: E402
from mistill.distributed import barrier, gather, init_world  # noqa: E402

ARMS = ("vanilla-bf16", "mistill", "mistill-fp32")
"""The bf16 arms replicate the weights; ``mistill-fp32`` (fp32 master weights, measured last,
on the same weights cast to fp32) is sharded by FSDP on several processes (``sharding=auto``)."""
GLOBAL_BATCH = 8
SMOKE_GLOBAL_BATCH = 2
"""The smoke mode's global batch: the same code path, a quarter of the micro-steps."""


def run(args) -> None:
    world = init_world("cpu" if args.smoke else "cuda")
    tokenizer = smoke_tokenizer(args.tokenizer) if args.smoke or args.tokenizer == "embedded" else args.tokenizer
    setup = student_setup(tokenizer, args.extra_lines, smoke=args.smoke)
    lm, nd, pools, targets, pairing = (setup[k] for k in ("lm", "nd", "pools", "targets", "pairing"))
    batch = SMOKE_GLOBAL_BATCH if args.smoke else GLOBAL_BATCH
    res: dict = {"world_size": world.size, "global_batch": batch, **setup["res"]}
    cuda = not args.smoke
    for name in ARMS:
        arm = resolve_arm(name)
        recipe = RecipeConfig(precision=arm.precision, grad_accum=batch, epochs=1)
        model = prepare_student(lm.model, recipe)

        def micro_step(m, idx, arm=arm):
            return micro_step_loss(m, lm, nd, targets, pairing, pools, arm)

        # two optimizer steps' worth of examples: the first warms kernels and the allocator up
        trainer = Trainer(model, 2 * batch, recipe, micro_step, world=world)
        trainer.train(stop_after=1, progress=False)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        barrier(world)
        t0 = time.perf_counter()
        trainer.train(stop_after=1, progress=False)
        if cuda:
            torch.cuda.synchronize()
        barrier(world)
        elapsed = time.perf_counter() - t0
        peaks = gather(torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else 0.0, world)
        res[f"{name}_step_s"] = elapsed
        res[f"{name}_samples_per_s"] = batch / elapsed
        res[f"{name}_peak_gib_max_over_ranks"] = max(peaks)
        res[f"{name}_fsdp"] = trainer.fsdp
        del trainer
        if cuda:
            torch.cuda.empty_cache()
    if world.leader:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2))
        print(json.dumps(res, indent=2))


def compare(one: Path, many: Path) -> dict:
    a, b = (json.loads(p.read_text()) for p in (one, many))
    out = {"world_sizes": [a["world_size"], b["world_size"]], "card": b["card"]}
    for name in ARMS:
        out[f"{name}_samples_per_s_one"] = a[f"{name}_samples_per_s"]
        out[f"{name}_samples_per_s_many"] = b[f"{name}_samples_per_s"]
        out[f"{name}_speedup"] = b[f"{name}_samples_per_s"] / a[f"{name}_samples_per_s"]
        out[f"{name}_peak_gib_many"] = b[f"{name}_peak_gib_max_over_ranks"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default="carry/smollm2-tokenizer")
    ap.add_argument("--extra-lines", type=int, default=950)
    ap.add_argument("--out", default="bench_ddp_step.json")
    args = run_or_compare(ap, compare)
    if args is not None:
        if args.smoke:
            args.extra_lines = 0
        run(args)


if __name__ == "__main__":
    main()
