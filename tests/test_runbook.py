"""The paper's plan: its steps read only earlier steps, each estimate is the recorded benchmark
figure times the workload, and a result selector keeps what those results need."""

from __future__ import annotations

import pytest

from mistill.errors import MistillInputError
from mistill.runbook import Figures, PaperCounts, Workload, estimate, paper_plan, render, select


def test_every_step_reads_only_earlier_steps():
    plan = paper_plan()
    seen: set[str] = set()
    for step in plan:
        assert set(step.needs) <= seen, step.name
        assert step.name not in seen
        seen.add(step.name)
    trains = [s for s in plan if s.entry_point == "train"]
    assert {s.params["arm"] for s in trains} >= {"mistill", "vanilla-fp32", "vanilla-bf16", "opd", "gold"}
    # App. J.4's seeds: three for Qwen3-4B Mistill, two for SmolLM3-3B's; GOLD on SmolLM3-3B only
    assert sum(s.params["arm"] == "mistill" and s.params["student"] == "{student}" for s in trains) == 3
    assert sum(s.params["arm"] == "mistill" and s.params["student"] == "{student_smollm3}" for s in trains) == 2
    assert [s.params["student"] for s in trains if s.params["arm"] == "gold"] == ["{student_smollm3}"]


def test_every_step_binds_its_entry_points_inputs_to_earlier_steps():
    """Each input names a field of the entry point's config and a step (or a composite step's nested
    run) that produces what the field takes; every required input is bound; placeholders are roles."""
    import dataclasses
    import re

    from mistill.runbook import COMPOSITE, ROLES
    from mistill.stages.registry import stages

    table = stages()
    plan = {s.name: s for s in paper_plan()}
    for step in plan.values():
        stage = table[step.entry_point]
        fields = {f.name for f in dataclasses.fields(stage.config)}
        assert set(step.inputs) <= fields and set(step.params) <= fields, step.name
        by_field = {f: name for name, f in stage.inputs.items()}
        by_field.setdefault("train_prepare_run", "prepare")  # the shortlist's retriever notes
        for f, ref in step.inputs.items():
            source, _, nested = ref.partition(":")
            produced = nested or plan[source].entry_point
            wanted = stage.input_stage(by_field[f])
            standing = {s.name for s in table.values() if s.stands_for == wanted}
            assert produced == wanted or produced in standing, (step.name, f, ref)
            if nested:
                assert nested in COMPOSITE[plan[source].entry_point]
        for f in stage.required_inputs().values():
            assert f in step.inputs, (step.name, f)
        for value in step.params.values():
            assert set(re.findall(r"{(\w+)}", value)) <= set(ROLES), (step.name, value)


def test_an_estimate_is_the_recorded_figure_times_the_workload():
    figures = Figures.load()
    per_note = figures.get("instrument.qwen3-14b.attribution_pass_s")
    tokens = figures.get("instrument.qwen3-14b.tokens")
    assert per_note and tokens
    est = estimate(Workload("characterize", "qwen3-14b", 100, 53_000), figures)
    assert est.gpu_hours == pytest.approx(100 * per_note * 53_000 / tokens / 3600)
    assert est.keys == ("instrument.qwen3-14b.attribution_pass_s", "instrument.qwen3-14b.tokens")
    step = figures.get("train_step.qwen3-4b.mistill_step_s")
    est = estimate(Workload("train_mistill", "qwen3-4b", 986, int(figures.get("train_step.qwen3-4b.tokens"))),
                   figures)
    assert est.gpu_hours == pytest.approx(986 * step / 3600)
    # generation: the prefill at the nearest recorded prompt length, scaled, plus the new tokens
    prefill = figures.get("generate.qwen3-14b.p36000.prefill_s")
    per_token = figures.get("generate.qwen3-14b.p36000.decode_per_token_s")
    assert prefill and per_token
    est = estimate(Workload("generate", "qwen3-14b", 10, 30_000, 6_000), figures)
    assert est.gpu_hours == pytest.approx(10 * (prefill * 30_000 / 36_000 + 6_000 * per_token) / 3600)
    assert est.keys == ("generate.qwen3-14b.p36000.prefill_s", "generate.qwen3-14b.p36000.decode_per_token_s")
    far = estimate(Workload("generate", "qwen3-14b", 1, 100_000, 1), figures)
    assert far.keys[0] == "generate.qwen3-14b.p106000.prefill_s"
    # on-policy: the measured step plus the rest of the rollout at the student's time per token
    opd = figures.get("onpolicy_step.qwen3-4b.opd_step_s")
    student_token = figures.get("generate.qwen3-4b.p36000.decode_per_token_s")
    est = estimate(Workload("train_opd", "qwen3-4b", 100, 36_000, 2_256), figures)
    assert est.gpu_hours == pytest.approx(100 * (opd + 2_000 * student_token) / 3600)
    off = figures.get("onpolicy_step.qwen3-4b.gold_off_policy_step_s")
    gold_on = figures.get("onpolicy_step.qwen3-4b.gold_on_policy_step_s")
    est = estimate(Workload("train_gold", "qwen3-4b", 100, 36_000, 256, 0.25), figures)
    assert est.gpu_hours == pytest.approx(100 * (0.25 * gold_on + 0.75 * off) / 3600)
    # no recorded figure: said, not guessed
    assert estimate(Workload("evaluate", "gemma-7b", 1, 1, 1), figures).gpu_hours is None
    assert estimate(Workload("shortlist"), figures).gpu_hours is None
    assert estimate(Workload("characterize", "qwen3-14b", 1, 1), Figures({})).gpu_hours is None
    assert estimate(Workload("none"), figures).gpu_hours == 0.0


def test_the_rendered_plan_totals_its_estimates():
    figures = Figures.load()
    plan = paper_plan(PaperCounts(train_notes=10))
    text = render(plan, figures, reused={"HD-001/prepare": "run123"})
    total = sum(e.gpu_hours for e in (estimate(s.work, figures) for s in plan) if e.gpu_hours is not None)
    assert f"{total:.1f} GPU-hours" in text
    assert "[reuse run123]" in text and f"{len(plan)} steps" in text


def test_a_result_selection_keeps_what_it_needs():
    plan = paper_plan()
    names = [s.name for s in select(plan, ["R-D4"])]
    assert "DT-000/train_qwen3-4b_opd_s0" in names and "DT-000/train_smollm3-3b_gold_s0" in names
    assert "DT-000/targets" in names and "DT-000/shortlist" in names  # what the arms read
    assert not any(n.startswith("HD-") for n in names)  # the characterization trees are not read
    assert "DT-000/teacher_attribute" in names and "DT-000/student_attribute_qwen3-4b" not in names
    assert not any("mistill" in n for n in names)  # R-D4 names its arms
    assert names == [s.name for s in plan if s.name in set(names)]  # plan order
    # a composite step serves the entry points it nests (characterize runs events)
    assert "HD-001/characterize" in [s.name for s in select(plan, ["R-C1"])]
    assert select(plan, []) == plan
    # the ablations: the arms an entry lists, each with its evaluation and own heads, at their seeds
    names = [s.name for s in select(plan, ["R-D7"])]
    trains = [n for n in names if "/train_" in n]
    assert trains == [f"DT-001/train_qwen3-4b_{a}" for a in ("randheads_s0", "randheads_s1", "randheads_s2",
                                                               "randpos_s0", "randboth_s0")]
    assert "DT-001/own_heads_qwen3-4b_randpos_s0" in names and "DT-001/select_lambda" in names
    assert not any("vanilla" in n or n.endswith("mistill_s0") for n in names)
    fp32 = {s.name: s for s in plan}["DT-001/train_qwen3-4b_mistill-fp32_s2"]
    assert "DT-001/select_lambda_fp32" in fp32.needs and "DT-001/select_lambda" not in fp32.needs
    with pytest.raises(MistillInputError) as err:
        select(plan, ["R-Z9"])
    assert err.value.field == "results"


def test_the_command_prints_the_selected_plan(capsys):
    from mistill.runbook import main

    main(["--results", "R-D4"])
    out = capsys.readouterr().out
    assert "DT-000/train_smollm3-3b_gold_s0" in out and "DT-001/train_qwen3-4b_mistill_s0" not in out
    assert "GPU-hours" in out and "results.json" in out
    assert out.startswith("R-D4: the DistiLLM-2, OPD and GOLD baselines (produced)")


def test_a_corpus_sets_the_lengths_and_split_sizes_of_the_estimate():
    """The embedded default's synthetic corpus, tokenized as the embedded model reads it: its
    median prompt + trace replaces the paper's full-inventory length, and the characterization
    estimate scales with it."""
    import statistics

    from mistill.data.synthetic import make_synthetic_corpus
    from mistill.models.loading import embedded_tokenizer
    from mistill.runbook import corpus_counts
    from mistill.stages.prepare import prompt_lengths

    corpus = make_synthetic_corpus(n_notes=6, seed=0)
    lengths = prompt_lengths(corpus, embedded_tokenizer())
    counts = corpus_counts(corpus, lengths)
    median = int(statistics.median(n.total_tokens for n in lengths))
    assert counts.full_prompt_tokens == median and counts.shortlist_tokens == PaperCounts().shortlist_tokens
    assert counts.train_notes == sum(n.split == "train" for n in corpus.notes) > 0
    figures = Figures.load()
    step = next(s for s in paper_plan(counts) if s.name == "HD-001/characterize")
    assert step.work.tokens == median
    assert estimate(step.work, figures).gpu_hours == pytest.approx(
        counts.characterization_traces * figures.get("instrument.qwen3-14b.attribution_pass_s") * median
        / figures.get("instrument.qwen3-14b.tokens") / 3600)


def test_the_command_reads_a_prepare_runs_corpus(tracking_uri, tmp_path, monkeypatch, capsys):
    from mistill.runbook import main, prepared_counts
    from mistill.stages.prepare import PrepareConfig, run_prepare
    from stage_fixtures import TINY, unique

    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "root"))
    run = run_prepare(PrepareConfig(corpus="synthetic", corpus_name=unique("runbook"), n_notes=4, model=TINY))
    counts = prepared_counts(run)
    assert counts.full_prompt_tokens != PaperCounts().full_prompt_tokens
    main(["--prepare-run", run, "--results", "R-C1"])
    out = capsys.readouterr().out
    assert f"x ({counts.full_prompt_tokens} / " in out  # the characterization at the corpus's length
