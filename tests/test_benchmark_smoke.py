"""The sampling benchmarks' ``--smoke`` modes: the code path each device benchmark times, on a tiny
model on the CPU, so that a change to the backends or the stages that breaks a benchmark fails
here rather than on the GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _smoke(script: str, out: Path) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MLFLOW_DISABLE_TELEMETRY": "true"}
    env.pop("MLFLOW_TRACKING_URI", None)  # the evaluate benchmark starts a server of its own
    subprocess.run([sys.executable, str(REPO / "benchmarks" / script), "--smoke", "--out", str(out)],
                   check=True, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    return json.loads(out.read_text())


def test_bench_sampling_smoke_generates_every_token_it_times(tmp_path):
    res = _smoke("bench_sampling.py", tmp_path / "sampling.json")
    for batch in (1, 3):
        key = f"hf_batched.smoke.p24.b{batch}.n4"
        assert res[f"{key}.tokens"] == batch * 4
        assert res[f"{key}.wall_s"] > 0 and res[f"{key}.per_token_s"] == res[f"{key}.wall_s"] / (batch * 4)


def test_bench_evaluate_smoke_runs_the_stage_end_to_end(tmp_path):
    res = _smoke("bench_evaluate.py", tmp_path / "evaluate.json")
    assert res["status"] == "FINISHED" and res["backend"] == "hf" and res["n_notes"] == 3
    assert res["mean_generated_tokens"] == 8 and res["evaluate_s"] > 0


def test_bench_hf_decode_smoke_times_every_step_it_asks_for(tmp_path):
    res = _smoke("bench_hf_decode.py", tmp_path / "hf_decode.json")
    prefix = "smoke.p24"
    first = res[f"{prefix}.b4_static_compile_greedy_1.steps"]
    assert first == 4  # one clock tick per generated token
    for tag in ("b4_static_compile_greedy_2", "b4_static_compile_sampled", "b16_static_compile_greedy"):
        assert res[f"{prefix}.{tag}.steps"] == 4
        assert 0 < res[f"{prefix}.{tag}.prefill_s"] < res[f"{prefix}.{tag}.total_s"]
    assert res[f"{prefix}.b4_dynamic_greedy.steps"] == 2
