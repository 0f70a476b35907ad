"""Summarise a pipeline's runs from a tracking store: each run's stage, wall time, final metrics and
peak GPU memory, and the report's tables; or compare two such summaries (GPU bf16 vs CPU float32).

Usage (``MLFLOW_TRACKING_URI`` names the store; a ``sqlite:///...`` URI reads a store directly):
    python benchmarks/gpu_pipeline_summary.py --experiment mistill/gpu --out summary.json [--report-dir D]
    python benchmarks/gpu_pipeline_summary.py --experiment mistill/gpu --prepare-run
    python benchmarks/gpu_pipeline_summary.py --compare gpu.json cpu.json [--rtol 0.05]
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import tarfile
import tempfile
from pathlib import Path

STAGE_TAG = "mistill.stage"
# readouts the pipeline's report rests on and that a bf16 GPU run must reproduce: M1 (teacher-forced
# margins of every evaluated model), the knock-in of the global sets against controls, and the
# own-heads readouts; every metric of the stages named here, the M1 metrics of evaluate runs
COMPARED_STAGES = ("knockin", "own_heads")
M1 = re.compile(r"^m1/")


def _client():
    from mlflow.tracking import MlflowClient  # deferred: mlflow.tracking is slow to import

    return MlflowClient()


def _runs(experiment: str) -> list:
    client = _client()
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise SystemExit(f"no experiment {experiment!r} on {client.tracking_uri if hasattr(client, 'tracking_uri') else 'the store'}")
    return client.search_runs([exp.experiment_id], max_results=5000, order_by=["attributes.start_time ASC"])


def prepare_run(experiment: str) -> str:
    """The finished ``prepare`` run of the experiment (the newest)."""
    runs = [r for r in _runs(experiment)
            if r.data.tags.get(STAGE_TAG) == "prepare" and r.info.status == "FINISHED"]
    if not runs:
        raise SystemExit("no finished prepare run")
    return runs[-1].info.run_id


def _peak_gpu_mib(client, run) -> float | None:
    keys = [k for k in run.data.metrics if k.startswith("system/gpu_") and k.endswith("memory_usage_megabytes")]
    peaks = [max(m.value for m in client.get_metric_history(run.info.run_id, k)) for k in keys]
    return max(peaks) if peaks else None


def summarise(experiment: str, gpu_samples: str | None, report_dir: str | None) -> dict:
    client = _client()
    rows = []
    for r in _runs(experiment):
        wall = (r.info.end_time - r.info.start_time) / 1000.0 if r.info.end_time else None
        metrics = {k: v for k, v in sorted(r.data.metrics.items()) if not k.startswith("system/")}
        rows.append({"run_id": r.info.run_id, "name": r.info.run_name, "stage": r.data.tags.get(STAGE_TAG, ""),
                     "status": r.info.status, "wall_s": wall, "peak_gpu_mib": _peak_gpu_mib(client, r),
                     "metrics": metrics})
    out: dict = {"experiment": experiment, "runs": rows}
    if gpu_samples and Path(gpu_samples).exists():
        used = []
        with open(gpu_samples) as fh:
            for row in csv.reader(fh):
                if len(row) >= 2 and row[1].strip().endswith("MiB"):
                    used.append(float(row[1].strip().split()[0]))
        out["gpu_samples"] = len(used)
        out["peak_gpu_memory_used_mib"] = max(used) if used else None
    if report_dir:
        report = [r for r in rows if r["stage"] == "report" and r["status"] == "FINISHED"]
        if report:
            with tempfile.TemporaryDirectory() as tmp:
                local = client.download_artifacts(report[-1]["run_id"], "tables", tmp)
                with tarfile.open(Path(report_dir) / "report_tables.tar.gz", "w:gz") as tar:
                    tar.add(local, arcname="tables")
    return out


def _key(name: str) -> str:
    return name.replace(".", "/")


def _role(run_name: str) -> str:
    """A run's role, the same across the releases' run-name styles: ``evaluate-run:<id>-mistill-s0``
    and ``evaluate-smollm2-135m@every-other-mistill-λ0.01-test-s0`` both name the mistill arm's
    evaluation."""
    name = run_name.replace("embedded:", "")
    name = re.sub(r"run:[0-9a-f]{32}", "smollm2-135m@every-other", name)
    name = re.sub(r"-λ[0-9.e-]+(?=-)", "", name)
    return re.sub(r"-(val|test|train)(?=-s\d+$)", "", name)


def _by_run_name(summary: dict) -> dict[str, dict[str, float]]:
    """Compared metrics by run name (the last finished run of a name wins: reruns replace)."""
    out: dict[str, dict[str, float]] = {}
    for r in summary["runs"]:
        if r["status"] != "FINISHED":
            continue
        picked = {_key(k): v for k, v in r["metrics"].items()
                  if r["stage"] in COMPARED_STAGES or M1.match(_key(k))}
        if picked:
            name = _role(r["name"])
            out.setdefault(name, {}).update(picked)
    return out


def compare(a_path: str, b_path: str, rtol: float, atol: float) -> dict:
    a = _by_run_name(json.loads(Path(a_path).read_text()))
    b = _by_run_name(json.loads(Path(b_path).read_text()))
    rows = []
    for name in sorted(set(a) & set(b)):
        for k in sorted(set(a[name]) & set(b[name])):
            x, y = a[name][k], b[name][k]
            ok = abs(x - y) <= atol + rtol * abs(y)
            rows.append({"run": name, "metric": k, "a": x, "b": y, "within": ok})
    return {"n": len(rows), "n_within": sum(r["within"] for r in rows), "rtol": rtol, "atol": atol,
            "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experiment", default="mistill/gpu")
    ap.add_argument("--prepare-run", action="store_true", help="print the prepare run's id and stop")
    ap.add_argument("--gpu-samples", help="nvidia-smi CSV samples (timestamp, memory.used, utilization)")
    ap.add_argument("--report-dir", help="write the report's tables here as report_tables.tar.gz")
    ap.add_argument("--out", help="write the summary JSON here (default: stdout)")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two summaries' readouts")
    ap.add_argument("--rtol", type=float, default=0.05)
    ap.add_argument("--atol", type=float, default=0.05)
    args = ap.parse_args()
    if args.compare:
        result = compare(*args.compare, rtol=args.rtol, atol=args.atol)
    elif args.prepare_run:
        print(prepare_run(args.experiment))
        return
    else:
        result = summarise(args.experiment, args.gpu_samples, args.report_dir)
    text = json.dumps(result, indent=1, default=str)
    if args.out:
        Path(args.out).write_text(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
