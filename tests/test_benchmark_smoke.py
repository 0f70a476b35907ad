"""Every device benchmark's ``--smoke`` mode: the code path the benchmark times, on a tiny model on
the CPU, so that a change to the instrument, the backends or the stages that breaks a benchmark
fails here rather than on the GPU.

The scripts are found by a glob: a new script in ``benchmarks/`` is a benchmark unless it is named
in :data:`NOT_BENCHMARKS`, and a benchmark without a ``--smoke`` mode (argparse refuses the flag)
or without a check in :data:`CHECKS` fails its case."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]

NOT_BENCHMARKS = {
    "record.py": "copies a benchmark's raw output into results.json",
    "memtrace.py": "a module the training benchmarks import (peak-memory attribution)",
    "gpu_pipeline_summary.py": "summarises a pipeline's tracked runs; it times nothing itself",
}
SCRIPTS = sorted(p.name for p in (REPO / "benchmarks").glob("*.py") if p.name not in NOT_BENCHMARKS)


def _smoke(script: str, out: Path) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MLFLOW_DISABLE_TELEMETRY": "true"}
    env.pop("MLFLOW_TRACKING_URI", None)  # the evaluate benchmark starts a server of its own
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), "--smoke", "--out", str(out)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"{script} --smoke failed:\n{run.stderr[-4000:]}"
    # a benchmark of several processes writes a folder: its timing, and the gathered arrays
    return json.loads((out / "timing.json" if out.is_dir() else out).read_text())


def _positive(res: dict, *keys: str) -> None:
    for key in keys:
        assert math.isfinite(res[key]) and res[key] > 0, f"{key} = {res[key]}"


def _sampling(res: dict, out: Path) -> None:
    engines = ("hf_batched", "hf_masked", "hf_masked_eager")  # the batched path, the evidence-flip key mask's
    assert res["engine"] == ",".join(engines) and res["mask_heads"] == 3
    assert res["mask_check.rows"] == 8 and res["mask_check.agree"] == 8 and res["mask_check.changed_by_mask"] >= 6
    for engine in engines:
        _positive(res, f"{engine}.smoke.p24.warmup_s")
        for batch in (1, 3):
            key = f"{engine}.smoke.p24.b{batch}.n4"
            assert res[f"{key}.tokens"] == batch * 4
            _positive(res, f"{key}.wall_s")
            assert res[f"{key}.per_token_s"] == res[f"{key}.wall_s"] / (batch * 4)


def _evaluate(res: dict, out: Path) -> None:
    assert res["status"] == "FINISHED" and res["backend"] == "hf" and res["n_notes"] == 3
    assert res["mean_generated_tokens"] == 8
    _positive(res, "prepare_s", "evaluate_s")


def _hf_decode(res: dict, out: Path) -> None:
    prefix = "smoke.p24"
    assert res[f"{prefix}.b4_static_compile_greedy_1.steps"] == 4  # one clock tick per generated token
    for tag in ("b4_static_compile_greedy_2", "b4_static_compile_sampled", "b16_static_compile_greedy"):
        assert res[f"{prefix}.{tag}.steps"] == 4
        assert 0 < res[f"{prefix}.{tag}.prefill_s"] < res[f"{prefix}.{tag}.total_s"]
    assert res[f"{prefix}.b4_dynamic_greedy.steps"] == 2


def _generate(res: dict, out: Path) -> None:
    assert res["p24.prompt_tokens"] == 24 and res["p24.new_tokens"] == 4
    _positive(res, "p24.prefill_s", "p24.generate_s")


def _instrument(res: dict, out: Path) -> None:
    _positive(res, "prefill_s", "patch_forward_s_8", "patch_forward_s_16", "patches_per_s_sequential",
              "forward_backward_one_position_s", "attribution_pass_s")
    assert res["patches_per_s_batched_8"] == pytest.approx(8 / res["patch_forward_s_8"])
    assert res["attribution_events"] == 16 and res["attribution_exact_patches"] > 0
    # float32 on the CPU: the batched and one-variant-per-forward paths agree to rounding
    assert res["check_batched_math_vs_sequential_math_max_abs_nats"] < 1e-4
    assert res["fp32_batched_vs_sequential_max_abs_nats"] < 1e-4
    assert abs(res["fp32_knockin_all_heads_minus_clean_nats"]) < 1e-4


def _locus(res: dict, out: Path) -> None:
    _positive(res, "prefill_s", "walk_s", "probes_per_s_batch64", "probes_per_s_batch64_masked_math_only",
              "window_attribution_s_per_mention", "pass_a_s_per_mention", "pass_b_s_per_mention",
              "follow_through_s_per_mention", "null_windows_s")
    assert sum(res["walk_outcomes"].values()) == res["mentions"] == 3 and res["walk_probes"] > 0
    # the masked-only stand-in for the prefix attention computes what the split path does
    assert res["check_split_vs_masked_math_max_abs_nats"] < 1e-4
    assert res["check_batched_vs_single_probe_max_abs_nats"] < 1e-4


def _onpolicy_step(res: dict, out: Path) -> None:
    _positive(res, "vanilla_step_s", "opd_step_s", "gold_off_policy_step_s", "gold_on_policy_step_s")
    assert res["rollout_cap"] == 8 and res["opd_rollout_tokens"] == 8
    assert res["gold_teacher_completion_tokens"] == 16


def _prefill(res: dict, out: Path) -> None:
    assert set(res) >= {"kernels", "prefill", "chunks", "profile"}
    _positive(res["kernels"], "attn_layer_split_s", "prefill_split_s", "prefill_one_kernel_s", "pass_one_kernel_s")
    _positive(res["prefill"], "prefill_split_s", "prefill_flash_s", "prefill_cudnn_s", "pass_s")
    assert res["prefill"]["pass_exact_events"] == 10
    assert res["prefill"]["prefill_cudnn_logits_max_abs_diff"] < 1e-4  # the CPU: one math path under every name
    _positive(res["chunks"], "prefill_cudnn_c256_s", "prefill_cudnn_c512_s", "pass_s")
    _positive(res["profile"], "prefill_cudnn_s", "gpu_total_s")
    assert res["profile"]["top"]


def _readside(res: dict, out: Path) -> None:
    _positive(res, "prefill_s", "read_side_s", "edit_refeed16_s", "edit_refeed32_s", "key_block_event_s")
    assert res["events"] == 8 and res["panel_heads"] == 8
    assert res["rows_sum_max_error"] < 1e-4  # every captured attention row sums to one
    assert res["edit_refeed16_reads_per_s"] == pytest.approx(2 * 4 / res["edit_refeed16_s"])
    assert abs(res["edit_identity_minus_clean"]) < 1e-4 and abs(res["edit_ablated_minus_mean_ablate"]) < 1e-4


def _scaling(res: dict, out: Path) -> None:
    assert res["world_size"] == 1 and res["model"] == "tiny"
    _positive(res, "pass_s")
    assert res["notes_per_s"] == pytest.approx(res["notes"] / res["pass_s"])
    with np.load(out / "notes.npz") as notes:
        assert len(notes.files) == 3 * res["notes"]


def _ddp_step(res: dict, out: Path) -> None:
    assert res["world_size"] == 1 and res["global_batch"] == 2
    for arm in ("vanilla-bf16", "mistill", "mistill-fp32"):
        _positive(res, f"{arm}_step_s")
        assert res[f"{arm}_samples_per_s"] == pytest.approx(res["global_batch"] / res[f"{arm}_step_s"])


def _train_step(res: dict, out: Path) -> None:
    _positive(res, "targets_pass_s", "floor_fwd_bwd_s", "vanilla_step_s", "mistill_step_s")
    assert res["supervised_rows"] > 0 and res["supervised_events"] > 0
    assert res["mistill_over_vanilla"] == pytest.approx(res["mistill_step_s"] / res["vanilla_step_s"])


def _vllm_vs_hf(res: dict, out: Path) -> None:
    assert res["notes"] == 2 and len(res["prompt_tokens"]) == 2 and res["vllm_engine"] == "hf (smoke)"
    for side in ("hf", "vllm"):
        _positive(res, f"{side}_generate_s")
        assert 0 < res[f"{side}_generated_tokens"] <= 2 * 4
        assert res[f"{side}_tokens_per_s"] == pytest.approx(res[f"{side}_generated_tokens"] / res[f"{side}_generate_s"])


def _min_abs_margin(res: dict, out: Path) -> None:
    assert res["notes"] == 1 and res["threshold"] == 0.5
    assert sorted(res["steps"]) == ["0.0", "0.5"] and all(len(log) == 1 for log in res["steps"].values())
    assert all(s["all_finite"] for s in res["summary"].values())
    assert res["dropped_at_0.5"] and res["seconds"] > 0


def _invariants(res: dict, out: Path) -> None:
    _positive(res, "wall_s")
    assert res["pass"] and res["all_pass"], res["pass"]  # float32 on the CPU: far inside every threshold


def _profile_forward(res: dict, out: Path) -> None:
    _positive(res, "single_wall_s", "variants16_wall_s")


def _shortlist_las(res: dict, out: Path) -> None:
    _positive(res, "shortlist.description_s", "shortlist.note_s", "shortlist.head_note_epoch_s", "las.step_s",
              "las.predict_rationale_s", "las.predict_note_s")
    # 300 words in chunks of 128 words; a chunk of 128 vocabulary words plus [CLS] and [SEP]
    assert res["shortlist.chunks_per_note"] == 3 and res["shortlist.chunk_tokens"] == 130
    assert res["shortlist.codes"] == 40 and res["las.tokens"] == 48 and res["las.answer_tokens"] == 6


def _train_probe(res: dict, out: Path) -> None:
    _positive(res, "targets_chain_s")
    hf = res["hf"]
    assert res["steps"] == 1 and hf["backend"] == "hf" and hf["status"] == "FINISHED"
    assert len(hf["probe_s"]) == len(hf["step_s"]) == 1 and hf["probe_s"][0] > 0 and hf["train_s"] > hf["probe_s"][0]
    assert hf["mean_tokens"] == [4.0]  # a random student runs to the smoke's 4-token cap


CHECKS = {
    "bench_ddp_step.py": _ddp_step, "bench_evaluate.py": _evaluate, "bench_generate.py": _generate,
    "bench_hf_decode.py": _hf_decode, "bench_instrument.py": _instrument, "bench_invariants.py": _invariants, "bench_locus.py": _locus,
    "bench_onpolicy_step.py": _onpolicy_step, "bench_prefill.py": _prefill, "bench_readside.py": _readside,
    "bench_sampling.py": _sampling, "bench_scaling.py": _scaling, "bench_shortlist_las.py": _shortlist_las, "bench_train_probe.py": _train_probe, "bench_train_step.py": _train_step,
    "bench_vllm_vs_hf.py": _vllm_vs_hf, "min_abs_margin.py": _min_abs_margin,
    "profile_forward.py": _profile_forward,
}
"""What each benchmark's smoke output must show: the times it took are positive, the counts are what
it was asked for, and the exactness checks it records hold on the CPU's float32 math path."""


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_smoke_runs_and_records_what_it_times(script, tmp_path):
    assert script in CHECKS, f"{script}: a new benchmark needs a --smoke mode and a check in CHECKS"
    out = tmp_path / f"{Path(script).stem}.json"
    CHECKS[script](_smoke(script, out), out)


def test_the_training_probe_benchmark_refuses_to_start_without_disk_for_its_checkpoint(tmp_path):
    """On the card the train run writes its checkpoint before the probe: a benchmark started on a
    disk too full for it stops at once, saying so, before it builds a model or starts a server."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MLFLOW_DISABLE_TELEMETRY": "true"}
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_train_probe.py"), "--min-free-gib", "1e12",
                          "--root", str(tmp_path / "store"), "--model-root", str(tmp_path / "models")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "GiB free under" in run.stderr and "--min-free-gib" in run.stderr
    assert not (tmp_path / "models").exists()
