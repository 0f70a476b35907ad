"""Device benchmark of the ``evaluate`` stage end to end: a tracking server, a prepared synthetic
corpus, then ``evaluate`` of ``--notes`` notes with ``backend=auto`` (vLLM on a CUDA machine where it
is installed), timed as a user runs it.

The model is a directory (``--model``, e.g. a random-init Qwen3-4B that ``bench_sampling.py``
wrote, with its padded tokenizer and that tokenizer's chat template); a random model writes no
answer, so its generations run to ``--max-new-tokens`` and score nothing: this measures time, not
quality. Recorded: each stage's wall time (the engine's start, the sampling and the readouts
included), the backend the run's tag names, the generated tokens and the run's rates.

Usage (on the GPU machine; MLflow and the project's other packages installed):
    python3 benchmarks/bench_evaluate.py --model /root/bench-models/qwen3-4b --notes 16 --out raw.json
    python3 benchmarks/bench_evaluate.py --smoke      # the tiny model on the CPU, HF sampling, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mistill.stages.evaluate import EvaluateConfig, run_evaluate  # noqa: E402
from mistill.stages.prepare import PrepareConfig, run_prepare  # noqa: E402
from mistill.tracking.naming import TAG_BACKEND  # noqa: E402
from mistill.tracking.server import TrackingServer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/root/bench-models/qwen3-4b")
    ap.add_argument("--notes", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--root", default="", help="the tracking store's folder (default: a new temporary one)")
    ap.add_argument("--out", default="bench_evaluate.json")
    ap.add_argument("--smoke", action="store_true", help="the tiny model on the CPU: seconds")
    args = ap.parse_args()
    if args.smoke:
        args.model, args.notes, args.max_new_tokens, args.device, args.dtype = "tiny:qwen3", 3, 8, "cpu", "float32"
    root = Path(args.root or tempfile.mkdtemp(prefix="bench-evaluate-"))
    os.environ["MISTILL_ROOT"] = str(root / "mistill")
    tracking = TrackingServer(root)
    os.environ["MLFLOW_TRACKING_URI"] = tracking.start()  # and this process's credentials
    res: dict = {"model": args.model, "notes": args.notes, "max_new_tokens": args.max_new_tokens,
                 "device": args.device, "dtype": args.dtype}
    try:
        start = time.perf_counter()
        prep = run_prepare(PrepareConfig(corpus="synthetic", corpus_name=f"bench-evaluate-{int(time.time())}",
                                         n_notes=args.notes, model=args.model))
        res["prepare_s"] = time.perf_counter() - start
        start = time.perf_counter()
        run_id = run_evaluate(EvaluateConfig(prepare_run=prep, model=args.model, arm="teacher", split="",
                                             max_notes=args.notes, device=args.device, dtype=args.dtype,
                                             max_new_tokens=args.max_new_tokens))
        res["evaluate_s"] = time.perf_counter() - start
        from mlflow import MlflowClient  # deferred: MLflow is slow to import

        run = MlflowClient().get_run(run_id)
        res["backend"] = run.data.tags[TAG_BACKEND]
        res["status"] = run.info.status
        for key in ("n_notes", "mean_generated_tokens", "cap_rate", "valid_rate", "fidelity/ppl_median"):
            if key in run.data.metrics:
                res[key] = run.data.metrics[key]
        assert run.info.status == "FINISHED" and res["n_notes"] == args.notes
    finally:
        tracking.stop()
    print(json.dumps(res, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
