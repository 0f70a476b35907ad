"""Device benchmark of the generation probe during training (App. L.2), through each probe backend.

A tracking server, a tiny random teacher's characterization of ``--notes`` synthetic notes
(``prepare -> events -> attribute -> targets``; the teacher only supplies the traces), then the
``train`` stage of ``--arm`` on the student with ``probe_every=1`` for ``--steps`` optimizer steps
(no trainer checkpoints unless ``--checkpoint-every``),
once per backend of ``--backends``: ``hf`` (HF's batched generation with the model being trained)
and ``vllm`` (:class:`~mistill.evaluation.backends.SyncedVLLMBackend`: one engine for the run,
asleep between probes, given the student's current weights before each). Each probe samples
``--probe-notes`` validation notes to ``--probe-new`` tokens.

The student is a random-init architecture in bf16 (``bench_instrument.ARCHS``' Qwen3-4B by
default) saved to ``--model-root`` with the padded tokenizer ``bench_sampling.py`` writes, whose
ordinary text tokenizes as the teacher's does. A random model rarely closes its reasoning, so its
probe generations run to the cap: this times the probe, not its scores.

Recorded per backend, from the run: ``train_s`` (the stage's wall time: model load, engine
start, steps and probes), ``probe_s`` (``probe/seconds`` at each step: the engine's wake-up and
weight load included), ``step_s`` (``train/step_seconds``), ``peak_gib``
(``train/peak_memory_gib``), ``mean_tokens`` (``probe/mean_tokens``) and the backend the run's
tag ``mistill.probe_backend`` names.

Usage (on the GPU machine; MLflow, the project's other packages and, for ``vllm``, vLLM installed):
    python3 benchmarks/bench_train_probe.py --backends vllm hf --tokenizer carry/smollm2-tokenizer --out raw.json
    python3 benchmarks/bench_train_probe.py --smoke   # a 2-layer student on the CPU, the HF probe, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_instrument import ARCHS  # noqa: E402
from bench_sampling import model_dir  # noqa: E402

from mistill.stages.characterize import AttributeConfig, EventsConfig, run_attribute, run_events  # noqa: E402
from mistill.stages.distill import TAG_PROBE_BACKEND, TargetsConfig, TrainStageConfig, run_targets, run_train  # noqa: E402
from mistill.stages.prepare import PrepareConfig, run_prepare  # noqa: E402
from mistill.tracking.server import TrackingServer  # noqa: E402



def targets_run(notes: int, teacher: str) -> str:
    """The tiny teacher's targets run over ``notes`` synthetic notes."""
    prep = run_prepare(PrepareConfig(corpus="synthetic", corpus_name=f"bench-probe-{int(time.time())}",
                                     n_notes=notes, model=teacher))
    events = run_events(EventsConfig(prepare_run=prep, model=teacher, n_null=4))
    attribute = run_attribute(AttributeConfig(events_run=events, selftest_events=0, stability_splits=5))
    return run_targets(TargetsConfig(teacher_attribute_run=attribute))


def measure(targets: str, student: str, backend: str, args) -> dict:
    """One train run with the probe through ``backend``: what the run recorded."""
    from mlflow import MlflowClient  # deferred: MLflow is slow to import

    start = time.perf_counter()
    run_id = run_train(TrainStageConfig(targets_run=targets, student=student, arm=args.arm, max_steps=args.steps,
                                        grad_accum=1, epochs=args.steps, register=False, device=args.device,
                                        probe_every=1, probe_notes=args.probe_notes,
                                        probe_max_new_tokens=args.probe_new, probe_backend=backend,
                                        rollout_gpu_memory=args.engine_memory,
                                        checkpoint_every=args.checkpoint_every))
    wall = time.perf_counter() - start
    client = MlflowClient()
    run = client.get_run(run_id)

    def history(key: str) -> list[float]:
        return [m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]

    res = {"train_s": wall, "status": run.info.status, "backend": run.data.tags[TAG_PROBE_BACKEND],
           "probe_s": history("probe/seconds"), "step_s": history("train/step_seconds"),
           "mean_tokens": history("probe/mean_tokens"), "peak_gib": history("train/peak_memory_gib")}
    assert res["status"] == "FINISHED" and res["backend"] == backend, res
    assert len(res["probe_s"]) == args.steps, res
    return res


def summarize(res: dict) -> dict:
    """``res`` with flat per-backend keys for ``record.py`` beside the nested histories:
    ``<backend>_train_s``, ``_probe_first_s`` (the first probe: the HF path's compilation, the
    engine's first wake-up), ``_probe_last_s`` (a later probe, the steady state), ``_step_last_s``,
    ``_peak_gib`` (CUDA only)."""
    out = dict(res)
    for backend in ("vllm", "hf"):
        run = res.get(backend)
        if not isinstance(run, dict):
            continue
        out.update({f"{backend}_train_s": run["train_s"], f"{backend}_probe_first_s": run["probe_s"][0],
                    f"{backend}_probe_last_s": run["probe_s"][-1], f"{backend}_step_last_s": run["step_s"][-1]})
        if run["peak_gib"]:  # logged on CUDA only
            out[f"{backend}_peak_gib"] = max(run["peak_gib"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--student", default="qwen3-4b", choices=(*sorted(ARCHS), "smollm3-3b"))
    ap.add_argument("--arm", default="vanilla-bf16")
    ap.add_argument("--backends", nargs="+", default=["vllm", "hf"], choices=("vllm", "hf"))
    ap.add_argument("--notes", type=int, default=40, help="synthetic notes (the probe reads their validation split)")
    ap.add_argument("--probe-notes", type=int, default=8)
    ap.add_argument("--probe-new", type=int, default=256, help="the probe's token cap")
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps, a probe after each")
    ap.add_argument("--engine-memory", type=float, default=0.2, help="the probe engine's share of the card")
    ap.add_argument("--max-pos", type=int, default=8192, help="the student's position window")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokenizer", default="carry/smollm2-tokenizer", help="a tokenizer directory or 'embedded'")
    ap.add_argument("--model-root", default="/root/bench-models")
    ap.add_argument("--root", default="", help="the tracking store's folder (default: a new temporary one)")
    ap.add_argument("--out", default="bench_train_probe.json")
    ap.add_argument("--checkpoint-every", type=int, default=0,
                    help="the train run's checkpoint interval (0: none; a Qwen3-4B full-state checkpoint is about "
                         "20 GB, written beside the previous one: this times the probe, not the disk)")
    ap.add_argument("--min-free-gib", type=float, default=25.0,
                    help="refuse to start with less free disk under the store's folder (the student's weights, "
                         "the trained copy and, with --checkpoint-every, about 40 GB more)")
    ap.add_argument("--smoke", action="store_true", help="a 2-layer student on the CPU, the HF probe: seconds")
    args = ap.parse_args()
    if args.smoke:
        args.student, args.backends, args.notes, args.probe_notes, args.probe_new = "smoke", ["hf"], 3, 1, 4
        args.steps = 1
        args.device, args.tokenizer, args.max_pos = "cpu", "embedded", 4096
        args.model_root = tempfile.mkdtemp(prefix="bench-train-probe-")
    root = Path(args.root or tempfile.mkdtemp(prefix="bench-train-probe-"))
    root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root).free / 2 ** 30
    if not args.smoke and free < args.min_free_gib:
        sys.exit(f"only {free:.1f} GiB free under {root}, --min-free-gib {args.min_free_gib:g}: the train run "
                 f"writes the trained student (and its checkpoints) there; free space (earlier benchmarks' models "
                 f"under {args.model_root}) or pass --root on a larger disk")
    student = str(model_dir(args.student, Path(args.model_root), args.max_pos, args.tokenizer, args.device))
    # the teacher: a 2-layer random Qwen3 with the same tokenizer, on the CPU (it only supplies traces)
    teacher = str(model_dir("smoke", Path(args.model_root), args.max_pos, args.tokenizer, "cpu"))
    os.environ["MISTILL_ROOT"] = str(root / "mistill")
    tracking = TrackingServer(root)
    os.environ["MLFLOW_TRACKING_URI"] = tracking.start()  # and this process's credentials
    res: dict = {"card": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu-smoke",
                 "torch": torch.__version__, "student": args.student, "arm": args.arm, "steps": args.steps,
                 "probe_notes": args.probe_notes, "probe_new": args.probe_new, "engine_memory": args.engine_memory}
    if "vllm" in args.backends:
        import vllm  # deferred: vLLM is optional

        res["vllm_version"] = vllm.__version__
    try:
        start = time.perf_counter()
        targets = targets_run(args.notes, teacher)
        res["targets_chain_s"] = time.perf_counter() - start
        for backend in args.backends:
            res[backend] = measure(targets, student, backend, args)
            print(f"{backend}: {json.dumps(res[backend])}", flush=True)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(summarize(res), indent=2))
    finally:
        tracking.stop()
    text = json.dumps(summarize(res), indent=2)
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
