"""The evidence-flip test (App. N; R-D33, R-D34): the answer scores, the per-case readings on
hand-made answers, the ``flip_test`` stage end to end on a synthetic frozen cohort, Table 54, and
the causal half's key masks (the masked prompt tokens, the masked runs)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from analysis import flip_tables
from mistill.data.flips import CONDITIONS
from mistill.errors import MistillInputError
from mistill.evaluation import flip_test as ft
from mistill.evaluation.generation import DecodingConfig
from mistill.stages.flip_cohort import FlipCohortConfig, run_flip_cohort
from mistill.stages.flip_test import FlipTestConfig, run_flip_test
from mistill.stages.prepare import PrepareConfig, run_prepare
from mistill.stages.report import ReportConfig, run_report
from stage_fixtures import TINY, artifact_paths, unique

LOCK = """study: ef-test
draw: {n: 4, seed: 0}
eligibility: {teacher_success: true}
disjoint: true
review: {budget: 3, reason_codes: [no_coherent_flip, pair, evidence]}
conditions: [original, flipped, irrelevant, order]
"""


def test_an_answer_scores_plus_one_for_a_alone_minus_one_for_b_alone():
    assert ft.flip_value({"N18.9", "I10"}, "N18.9", "N18.5") == 1
    assert ft.flip_value({"N18.5"}, "N18.9", "N18.5") == -1
    assert ft.flip_value({"N18.9", "N18.5"}, "N18.9", "N18.5") == 0 == ft.flip_value(set(), "N18.9", "N18.5")
    # categories: N18.x against E11.x differ; N18.9 against N18.5 share theirs (always 0)
    assert ft.category_value({"N18.4"}, "N18.9", "E11.9") == 1 and ft.category_value({"E11.65"}, "N18.9", "E11.9") == -1
    assert ft.category_value({"N18.9"}, "N18.9", "N18.5") == 0
    row = ft.sample_row("c", "original", 0, 7, {"N18.9"}, valid=False, capped=True, n_tokens=9, a="N18.9", b="N18.5")
    assert (row["v"], row["emits_a"], row["valid"]) == (0, False, False)  # an invalid answer is not read


def test_the_seed_key_is_the_case_and_the_sample_index():
    dec = DecodingConfig(seed=0)
    seeds = {ft.sample_seed(dec, case, k) for case in ("a", "b") for k in range(4)}
    assert len(seeds) == 8 and ft.sample_seed(dec, "a", 2) == ft.sample_seed(DecodingConfig(seed=0, top_k=5), "a", 2)
    assert ft.sample_seed(DecodingConfig(seed=1), "a", 2) != ft.sample_seed(dec, "a", 2)


def _answers(values: dict[str, dict[str, list[int]]], invalid: set = frozenset()) -> pd.DataFrame:
    """Rows of SAMPLE_COLUMNS from ``case -> condition -> [v per sample]`` (v_category = v); the
    samples in ``invalid`` are invalid answers (v = 0)."""
    rows = []
    for case, by_cond in values.items():
        for cond, vs in by_cond.items():
            for k, v in enumerate(vs):
                bad = (case, cond, k) in invalid
                v = 0 if bad else v
                rows.append({"case_id": case, "condition": cond, "sample": k, "seed": k, "valid": not bad,
                             "capped": bad, "n_tokens": 5, "emits_a": v == 1, "emits_b": v == -1, "v": v,
                             "v_category": v})
    return pd.DataFrame(rows, columns=list(ft.SAMPLE_COLUMNS))


def test_case_readings_by_hand():
    answers = _answers({
        "c1": {"original": [1, 1, 1, 0], "flipped": [-1, 1, 0, -1], "irrelevant": [1, 1, 0, 0], "order": [1, 1, 1, 1]},
        "c2": {"original": [1, 0, 0, 0], "flipped": [1, 1, 1, 1], "irrelevant": [1, 0, 0, 0], "order": [-1, 0, 0, 0]},
    }, invalid={("c2", "flipped", 3), ("c2", "order", 1)})
    cases = ft.case_readings(answers, {"c1": True, "c2": False})
    c1, c2 = cases.loc["c1"], cases.loc["c2"]
    assert c1["D"] == pytest.approx((0.75 + 0.25) / 2) and c2["D"] == pytest.approx((0.25 - 0.75) / 2)
    assert (c1["follow_original"], c1["follow_flipped"], c1["s"]) == (0.75, 0.5, 0.625)
    assert c1["paired_success"] == 0.25  # sample 0 only: +1 under the original and -1 under the flip
    assert (c1["agreement_irrelevant"], c1["agreement_order"]) == (0.75, 0.75)
    assert (c1["expected_irrelevant"], c1["expected_order"]) == (0.5, 1.0)
    assert c2["agreement_order"] == 0.75 and c1["invalid"] == 0.0 and c2["invalid"] == 2 / 16
    for c in (c1, c2):  # the decomposition sums to D
        assert c["d_lose_a"] + c["d_adopt_b"] == pytest.approx(c["D"])
    assert c1["d_adopt_b"] == 0.25 and c2["d_adopt_b"] == 0.0
    assert c1["D_category"] == pytest.approx(c1["D"]) and np.isnan(c2["D_category"])
    summary = ft.checkpoint_readings(cases, n_resamples=200)
    assert summary["n_cases"] == 2 and summary["n_cases_category"] == 1
    assert summary["D"] == pytest.approx(cases["D"].mean())
    assert summary["D_lo"] <= summary["D"] <= summary["D_hi"]
    assert summary["D_category"] == pytest.approx(c1["D"]) and summary["D_category_lo"] == summary["D_category_hi"]
    with pytest.raises(ValueError, match="same number of samples"):
        ft.case_readings(answers.iloc[1:], {"c1": True, "c2": False})


@pytest.fixture(scope="module")
def flip_runs(tracking_uri, tmp_path_factory, pinned_code_version):
    """A synthetic frozen cohort of 3 cases, a draw-only cohort run, and the tiny model's
    flip_test on the cohort (2 samples, 6 tokens): run ids, the corpus and the root."""
    root = tmp_path_factory.mktemp("flip-test-root")
    lock = root / "lock.yaml"
    lock.write_text(LOCK)
    name = unique("flip-test")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MISTILL_ROOT", str(root))
        prep = run_prepare(PrepareConfig(corpus="synthetic", corpus_name=name, n_notes=6, codes_per_note=(3, 4),
                                         inventory_size=60, model=TINY))
        exclude = run_prepare(PrepareConfig(corpus="synthetic", corpus_name=unique("flip-test-train"), n_notes=2,
                                            codes_per_note=(3, 4), inventory_size=60, model=TINY))
        common = dict(prepare_run=prep, exclude_prepare_runs=(exclude,), lock=str(lock), model=TINY)
        draw_only = run_flip_cohort(FlipCohortConfig(**common))
        cohort = run_flip_cohort(FlipCohortConfig(**common, synthetic_cases=True))
        cfg = FlipTestConfig(cohort_run=cohort, model=TINY, arm="teacher", samples=2, max_new_tokens=6)
        flip = run_flip_test(cfg)
    return {"root": root, "corpus": name, "draw_only": draw_only, "cohort": cohort, "flip_test": flip, "cfg": cfg}


def test_flip_test_end_to_end_on_a_synthetic_cohort(flip_runs, monkeypatch):
    monkeypatch.setenv("MISTILL_ROOT", str(flip_runs["root"]))
    with pytest.raises(MistillInputError, match="no condition corpora") as err:
        run_flip_test(FlipTestConfig(cohort_run=flip_runs["draw_only"], model=TINY, arm="teacher"))
    assert err.value.field == "cohort_run"
    run_id = flip_runs["flip_test"]
    client = MlflowClient()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["mistill.stage"] == "flip_test"
    assert run.data.tags["mistill.backend"] == "hf"
    assert {"flip_samples.csv", "flip_cases.csv"} <= artifact_paths(client, run_id)
    work = flip_runs["root"] / "work" / run_id
    samples = pd.read_csv(next(work.rglob("flip_samples.csv")), dtype={"case_id": str})
    n_cases = int(run.data.metrics["flip/n_cases"])
    assert n_cases == 3 and len(samples) == n_cases * len(CONDITIONS) * 2
    # one seed per case and sample index, shared by the four conditions
    seeds = samples.groupby(["case_id", "sample"])["seed"].nunique()
    assert (seeds == 1).all() and samples.groupby("case_id")["seed"].nunique().eq(2).all()
    # the untrained tiny model writes no answer in 6 tokens: every output invalid, scored 0, counted
    assert not samples["valid"].any() and (samples["v"] == 0).all()
    cases = pd.read_csv(next(work.rglob("flip_cases.csv")), dtype={"case_id": str}).set_index("case_id")
    assert cases["invalid"].eq(1.0).all() and cases["D"].eq(0.0).all()
    assert run.data.metrics["flip/invalid"] == 1.0 and run.data.metrics["flip/D"] == 0.0
    # recomputed from the logged answers, the logged readings agree
    differ = dict(zip(cases.index, cases["D_category"].notna(), strict=True))
    again = ft.case_readings(samples, differ)
    pd.testing.assert_frame_equal(again, cases[list(ft.CASE_READINGS)], check_names=False, check_dtype=False)
    assert run_flip_test(flip_runs["cfg"]) == run_id  # the finished run is reused


def test_the_locked_contrasts_pair_seeds_and_cluster_by_case():
    """Primary: bf16 Mistill minus bf16 Vanilla CoT-KD, seed i with seed i, each case's mean over
    the seed pairs; the fp32 pair has no runs here, so no secondary row."""
    d = {("mistill", 0): [0.5, 0.25, 0.0], ("mistill", 1): [0.25, 0.25, 0.5],
         ("vanilla-bf16", 0): [0.25, 0.25, 0.25], ("vanilla-bf16", 1): [0.0, 0.5, 0.5],
         ("vanilla-bf16", 2): [0.0, 0.0, 0.0]}
    runs = pd.DataFrame([{"run_id": f"{arm}-{seed}", "params.cohort_run": "c", "model": "m", "arm": arm,
                          "precision": "bf16", "seed": seed} for arm, seed in d])
    cases = pd.DataFrame([{"run_id": f"{arm}-{seed}", "case_id": f"k{i}", "D": v}
                          for (arm, seed), vs in d.items() for i, v in enumerate(vs)])
    table = flip_tables.flip_contrasts_table(runs, cases, n_resamples=200)
    assert list(table["contrast"]) == ["primary"]
    row = table.iloc[0]
    per_case = [np.mean([0.5 - 0.25, 0.25 - 0.0]), np.mean([0.0, -0.25]), np.mean([-0.25, 0.0])]
    assert row["seed_pairs"] == 2 and row["n_cases"] == 3  # seed 2 has no Mistill partner
    assert row["mean_diff"] == pytest.approx(np.mean(per_case)) and row["median_diff"] == pytest.approx(-0.125)
    assert (row["cases_higher"], row["cases_lower"], row["cases_tied"]) == (1, 2, 0)
    assert row["ci_low"] <= row["mean_diff"] <= row["ci_high"]
    assert row["per_pair"] == "s0-s0 +0.000; s1-s1 +0.000"


def test_a_mask_span_becomes_the_prompt_tokens_that_show_it(flip_runs, monkeypatch):
    """Every masked character of the note is inside a masked prompt token, and every masked
    token shows some masked character (a token counts when any of its characters is)."""
    from mistill.data.flips import prompt_positions, token_offsets
    from mistill.stages.common import load_prepared, load_tokenizer

    monkeypatch.setenv("MISTILL_ROOT", str(flip_runs["root"]))
    tags = MlflowClient().get_run(flip_runs["cohort"]).data.tags
    tokenizer = load_tokenizer(TINY)
    seen = 0
    for cond in ("original", "flipped"):
        prepared = load_prepared(tags[f"mistill.flip_cohort.run.{cond}"])
        for note in prepared.corpus.notes:
            prompt = prepared.prompt(note, tokenizer)
            spans = [tuple(s) for s in note.meta["target_mask"]]
            positions = prompt_positions(prompt, note, spans, tokenizer)
            offsets = token_offsets(tokenizer, prompt.text)
            words = {note.text[a:b].strip() for a, b in spans}
            shown = "".join(prompt.text[offsets[i][0]:offsets[i][1]] for i in positions)
            assert positions == sorted(set(positions)) and all(w in shown for w in words if w)
            assert all(b > a for a, b in (offsets[i] for i in positions))
            seen += bool(positions)
    assert seen >= 3


def test_the_causal_half_masks_the_nominated_heads_on_the_hf_path(flip_runs, monkeypatch):
    monkeypatch.setenv("MISTILL_ROOT", str(flip_runs["root"]))
    base = dict(cohort_run=flip_runs["cohort"], model=TINY, arm="teacher", samples=1, max_new_tokens=4)
    for bad, field in ((dict(mask="target"), "mask_heads"), (dict(mask_heads=("L0H1",)), "mask"),
                       (dict(mask="sham", mask_heads=("L0H1",), backend="vllm"), "backend"),
                       (dict(mask="sham", mask_heads=("layer0",)), "mask_heads")):
        with pytest.raises(MistillInputError) as err:
            FlipTestConfig(**base, **bad).validate()
        assert err.value.field == field
    with pytest.raises(MistillInputError, match="no head L99H0"):
        run_flip_test(FlipTestConfig(**base, mask="target", mask_heads=("L99H0",)))
    client = MlflowClient()
    runs = {}
    for mask in ("target", "sham"):
        runs[mask] = run_flip_test(FlipTestConfig(**base, mask=mask, mask_heads=("L0H1", "L1H0")))
        run = client.get_run(runs[mask])
        assert run.data.tags["mistill.backend"] == "hf" and run.data.params["mask"] == mask
        work = flip_runs["root"] / "work" / runs[mask]
        doc = json.loads(next(work.rglob("key_mask.json")).read_text())
        assert doc["mask"] == mask and doc["heads"] == ["L0H1", "L1H0"]
        assert sum(doc["masked_tokens"][k] > 0 for k in doc["masked_tokens"] if k.endswith(".original")) >= 1
    assert runs["target"] != runs["sham"]


def test_the_report_lists_tables_54_and_55_from_flip_test_runs(flip_runs, tmp_path, monkeypatch):
    """Table 54's checkpoint rows from the behavioural run; Table 55 from a clean HF run and a
    target and a sham run of one head set; no locked contrast or interaction without trained arms;
    the execution-path offset of the teacher."""
    monkeypatch.setenv("MISTILL_ROOT", str(flip_runs["root"]))
    base = dict(cohort_run=flip_runs["cohort"], model=TINY, arm="teacher", samples=2, max_new_tokens=6)
    hf_runs = {"clean": run_flip_test(FlipTestConfig(**base, backend="hf"))}
    for mask in ("target", "sham"):
        hf_runs[mask] = run_flip_test(FlipTestConfig(**base, mask=mask, mask_heads=("L0H1", "L1H0")))
    client = MlflowClient()
    run_id = run_report(ReportConfig(corpus=flip_runs["corpus"], bootstrap=50, corpus_bootstrap=50))
    assert client.get_run(run_id).info.status == "FINISHED"

    def table(name: str) -> pd.DataFrame:
        return pd.read_csv(client.download_artifacts(run_id, f"tables/{name}.csv", str(tmp_path)))

    t54 = table("table54_flip_behaviour")
    assert list(t54["run_id"]) == [flip_runs["flip_test"]] and t54.loc[0, "arm"] == "teacher"
    metrics = client.get_run(flip_runs["flip_test"]).data.metrics
    for col in ("n_cases", "D", "s", "invalid", "d_lose_a", "d_adopt_b", "follow_flipped"):
        assert t54.loc[0, col] == pytest.approx(metrics[f"flip/{col}"])
    t55 = table("table55_flip_causal")
    assert len(t55) == 1 and t55.loc[0, "heads"] == "named" and t55.loc[0, "n_cases"] == 3
    d = {k: client.get_run(v).data.metrics["flip/D"] for k, v in hf_runs.items()}
    assert t55.loc[0, "D_clean"] == pytest.approx(d["clean"])
    assert t55.loc[0, "delta_target"] == pytest.approx(d["clean"] - d["target"])
    assert t55.loc[0, "target_minus_sham"] == pytest.approx(d["sham"] - d["target"])
    offsets = table("table55_flip_interaction")
    assert list(offsets["statistic"]) == ["execution-path offset"]  # no student pair for L here
    assert offsets.loc[0, "estimate"] == pytest.approx(metrics["flip/D"] - d["clean"])
    text = open(client.download_artifacts(run_id, "report.md", str(tmp_path / "r"))).read()
    assert "Table 54 (bottom)" in text and "no cohort with flip_test runs of both arms" in text


def test_the_causal_tables_by_hand():
    """ΔD per mask, target minus sham, and L from hand-made per-case D values."""
    d = {("mistill", "clean"): [0.5, 0.25, 0.0], ("mistill", "target"): [0.25, 0.25, 0.0],
         ("mistill", "sham"): [0.5, 0.0, 0.25], ("vanilla-bf16", "clean"): [0.25, 0.25, 0.25],
         ("vanilla-bf16", "target"): [0.0, 0.25, 0.25], ("vanilla-bf16", "sham"): [0.25, 0.25, 0.0]}
    rows = []
    for arm, kind in d:
        rows.append({"run_id": f"{arm}-{kind}", "params.cohort_run": "c", "model": "m", "arm": arm,
                     "precision": "bf16", "seed": 0, "start_time": 1, "params.backend": "hf",
                     "params.mask": "" if kind == "clean" else kind, "params.mask_heads": None,
                     "params.mask_k": "40", "params.mask_phase": "P2C"})
    runs = flip_tables.flip_runs(pd.DataFrame(rows))
    assert set(runs["kind"]) == {flip_tables.CLEAN_HF, flip_tables.MASKED} and set(runs["heads"]) == {"", "top40 P2C"}
    cases = pd.DataFrame([{"run_id": f"{arm}-{kind}", "case_id": f"k{i}", "D": v}
                          for (arm, kind), vs in d.items() for i, v in enumerate(vs)])
    causal = flip_tables.flip_causal_table(runs, cases, n_resamples=100).set_index("arm")
    m = causal.loc["mistill"]
    assert m["D_clean"] == pytest.approx(0.25) and m["delta_target"] == pytest.approx(np.mean([0.25, 0, 0]))
    assert m["target_minus_sham"] == pytest.approx(np.mean([0.25, -0.25, 0.25]))
    inter = flip_tables.flip_interaction_table(runs, cases, n_resamples=100)
    assert list(inter["statistic"]) == ["L = G_sham - G_target"]
    g_sham = np.subtract(d[("mistill", "sham")], d[("vanilla-bf16", "sham")])
    g_target = np.subtract(d[("mistill", "target")], d[("vanilla-bf16", "target")])
    assert inter.loc[0, "estimate"] == pytest.approx(np.mean(g_sham - g_target))
