"""The paper's plan: its steps read only earlier steps, each estimate is the recorded benchmark
figure times the workload, and a result selector keeps what those results need."""

from __future__ import annotations

import dataclasses

import pytest

from mistill.errors import MistillInputError
from mistill.runbook import TRANSFER_TREES, Figures, PaperCounts, Workload, estimate, paper_plan, render, select


def figures_file(path, values: dict[str, float]) -> Figures:
    """A figures file as ``benchmarks/results.json`` records them, written to ``path`` and read."""
    import json

    path.write_text(json.dumps({k: {"value": v, "unit": "s"} for k, v in values.items()}), encoding="utf-8")
    return Figures.load(path)


def hf_only(tmp_path) -> Figures:
    """The recorded figures without any batched engine's or vLLM step's: the HF backend's path."""
    recorded = Figures.load().values
    return figures_file(tmp_path / "hf_only.json", {k: v for k, v in recorded.items()
                                                   if not k.startswith("sampling.") and not k.endswith("_vllm_s")})


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
    clinical = [s for s in trains if s.tree not in ("MQ", "PP", "LC")]
    assert sum(s.params["arm"] == "mistill" and s.params["student"] == "{student}" for s in clinical) == 3
    assert sum(s.params["arm"] == "mistill" and s.params["student"] == "{student_smollm3}" for s in clinical) == 3
    # App. O: three seeds of each arm on MuSiQue-Ans, Qwen3-4B the student
    musique = [(s.params["arm"], s.params["seed"], s.params["student"]) for s in trains if s.tree == "MQ"]
    assert sorted(musique) == [(arm, str(seed), "{student}") for arm in ("mistill", "randheads", "vanilla-bf16")
                               for seed in range(3)]
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
        by_field.setdefault("exclude_prepare_runs", "prepare")  # the corpora a flip cohort avoids
        by_field.setdefault("align_events_runs", "events")  # the students' realizations of the audited events
        for f, refs in step.inputs.items():
            assert f.endswith("_runs") or "," not in refs, (step.name, f)
            for ref in refs.split(","):
                source, _, nested = ref.partition(":")
                produced = nested or plan[source].entry_point
                wanted = stage.input_stage(by_field[f])
                standing = {s.name for s in table.values() if s.stands_for == wanted}
                standing |= set(stage.also.get(by_field[f], ()))  # further stages the input takes
                assert produced == wanted or produced in standing, (step.name, f, ref)
                if nested:
                    assert nested in COMPOSITE[plan[source].entry_point]
        for f in stage.required_inputs().values():
            assert f in step.inputs, (step.name, f)
        for value in step.params.values():
            assert set(re.findall(r"{(\w+)}", value)) <= set(ROLES), (step.name, value)


def test_an_estimate_is_the_recorded_figure_times_the_workload(tmp_path):
    figures = hf_only(tmp_path)  # generation and rollouts through the HF backend at batch 1
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
    assert estimate(Workload("shortlist", "gte-large", 10, 1_500), Figures({})).gpu_hours is None
    assert estimate(Workload("characterize", "qwen3-14b", 1, 1), Figures({})).gpu_hours is None
    assert estimate(Workload("none"), figures).gpu_hours == 0.0


RETRIEVER_LAS = {"shortlist.note_s": 0.05, "shortlist.note_words": 1_000, "shortlist.description_s": 0.001,
                 "shortlist.head_note_epoch_s": 1e-4, "shortlist.codes": 5_000, "las.step_s": 1.5, "las.tokens": 8_000,
                 "las.predict_rationale_batch_s": 0.8, "las.predict_note_batch_s": 0.3, "las.predict_batch": 16}


def test_the_retriever_and_the_las_simulator_are_costed_from_their_figures(tmp_path):
    figures = figures_file(tmp_path / "f.json", {**VLLM_4B, **RETRIEVER_LAS, "instrument.qwen3-4b.prefill_s": 2.0,
                                                 "instrument.qwen3-4b.tokens": 30_000})
    work = Workload("shortlist", "gte-large", 1_100, 1_500, head_notes=1_000, epochs=200, codes=5_651)
    est = estimate(work, figures)
    seconds = 1_100 * 0.05 * 1.5 + 5_651 * 0.001 + 200 * 1_000 * 1e-4 * 5_651 / 5_000
    assert est.gpu_hours == pytest.approx(seconds / 3600, rel=1e-12)
    assert "the head, on the host" in est.formula and "shortlist.head_note_epoch_s" in est.keys
    sim = estimate(Workload("las_simulator", "qwen3-1.7b", 493, 8_000, predictions=100), figures)
    assert sim.gpu_hours == pytest.approx((493 * 1.5 + 7 * (0.8 + 0.3)) / 3600, rel=1e-12)  # 7 batches of 16
    # evaluate adds the simulator's two predictions per note, in batches, to sampling and readouts
    plain = estimate(Workload("evaluate", "qwen3-4b", 150, 30_000, 6_000), figures)
    las = estimate(Workload("evaluate", "qwen3-4b", 150, 30_000, 6_000, predictions=150), figures)
    assert las.gpu_hours == pytest.approx(plain.gpu_hours + 10 * 1.1 / 3600, rel=1e-12)
    assert "the LAS simulator's predictions" in las.formula
    # a missing figure leaves the step uncosted and names the benchmark that records it
    bare = figures_file(tmp_path / "bare.json", {**VLLM_4B, "instrument.qwen3-4b.prefill_s": 2.0,
                                                  "instrument.qwen3-4b.tokens": 30_000})
    for w in (work, Workload("evaluate", "qwen3-4b", 150, 30_000, 6_000, predictions=150)):
        missing = estimate(w, bare)
        assert missing.gpu_hours is None and "bench_shortlist_las.py" in missing.formula
    # every evaluate step of the plan that reads a simulator predicts with it
    for step in paper_plan():
        if step.entry_point == "evaluate" and "las_run" in step.inputs:
            assert step.work.predictions == step.work.units
    sim_step = next(s for s in paper_plan() if s.entry_point == "las_simulator")
    assert sim_step.params["max_steps"] == str(PaperCounts().simulator_steps)


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
                                                               "randpos_s0", "randboth_s0")] + [
        f"DT-001/train_smollm3-3b_{a}" for a in ("randheads_s0", "randheads_s1", "randpos_s0")]
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


# sampling from a batched engine's measured wall times: walls of b prompts generating n tokens each
HF_4B = {"generate.qwen3-4b.p36000.prefill_s": 1.5, "generate.qwen3-4b.p36000.decode_per_token_s": 0.1}
VLLM_4B = {
    "sampling.vllm.qwen3-4b.p36000.b1.n256.wall_s": 10.0, "sampling.vllm.qwen3-4b.p36000.b1.n6000.wall_s": 200.0,
    "sampling.vllm.qwen3-4b.p36000.b16.n256.wall_s": 30.0, "sampling.vllm.qwen3-4b.p36000.b16.n6000.wall_s": 900.0,
    "sampling.vllm.qwen3-4b.p36000.b64.n256.wall_s": 80.0, "sampling.vllm.qwen3-4b.p36000.b64.n6000.wall_s": 3000.0,
    "sampling.vllm.qwen3-4b.p36000.b64.engine_start_s": 1.0, "sampling.vllm.qwen3-4b.p36000.b64.peak_gib": 1.0,
    "sampling.vllm.qwen3-4b.p24000.b64.n256.wall_s": 1.0, "sampling.vllm.qwen3-4b.p24000.b64.n6000.wall_s": 2.0,
    "sampling.vllm.qwen3-4b.p106000.b16.n256.wall_s": 90.0, "sampling.vllm.qwen3-4b.p106000.b16.n6000.wall_s": 1800.0,
}
HF_BATCHED_4B = {"sampling.hf_batched.qwen3-4b.p36000.b8.n256.wall_s": 1.0,
                 "sampling.hf_batched.qwen3-4b.p36000.b8.n6000.wall_s": 2.0}


def line(w1: float, w2: float, n1: int, n2: int, n: int, batch: int) -> float:
    """Seconds per note at ``n`` new tokens on the line through two measured batch walls."""
    return (w1 + (w2 - w1) * (n - n1) / (n2 - n1)) / batch


def test_sampling_is_costed_from_the_preferred_engines_measured_batch(tmp_path):
    from mistill.runbook import generation_estimate

    figures = figures_file(tmp_path / "f.json", {**HF_4B, **VLLM_4B, **HF_BATCHED_4B})
    # vLLM before batched HF (cheaper here), at the shortest recorded prompt at least the work's
    # (36000 for 30000; the shorter 24000 is passed over), the batch of least seconds per note
    est = estimate(Workload("generate", "qwen3-4b", 150, 30_000, 6_000), figures)
    assert est.gpu_hours == pytest.approx(150 * 3000.0 / 64 / 3600, rel=1e-9)
    assert est.keys == ("sampling.vllm.qwen3-4b.p36000.b64.n256.wall_s",
                        "sampling.vllm.qwen3-4b.p36000.b64.n6000.wall_s")
    assert "measured" in est.formula and "vllm" in est.formula and "batch 64" in est.formula
    assert "256" in est.formula and "6000" in est.formula and "an upper bound" in est.formula
    # between the measured counts: the line through them
    est = generation_estimate(Workload("generate", "qwen3-4b", 100, 36_000, 3_000), figures)
    assert est.gpu_hours == pytest.approx(100 * line(80.0, 3000.0, 256, 6000, 3_000, 64) / 3600, rel=1e-9)
    assert "bound" not in est.formula  # the work's own prompt length
    # a work of fewer notes than a batch cannot fill it: the largest batch that fits, b16
    est = estimate(Workload("generate", "qwen3-4b", 30, 30_000, 6_000), figures)
    assert est.gpu_hours == pytest.approx(30 * 900.0 / 16 / 3600, rel=1e-9)
    assert est.keys[0] == "sampling.vllm.qwen3-4b.p36000.b16.n256.wall_s"
    # the least time per note decides, not the largest batch
    cheap_b16 = {**VLLM_4B, "sampling.vllm.qwen3-4b.p36000.b16.n6000.wall_s": 600.0}
    est = estimate(Workload("generate", "qwen3-4b", 150, 30_000, 6_000), figures_file(tmp_path / "g.json", cheap_b16))
    assert est.gpu_hours == pytest.approx(150 * 600.0 / 16 / 3600, rel=1e-9) and "batch 16" in est.formula
    # beyond the measured counts: the same line, extrapolated and said so
    est = estimate(Workload("generate", "qwen3-4b", 64, 36_000, 8_000), figures)
    assert est.gpu_hours == pytest.approx(64 * line(80.0, 3000.0, 256, 6000, 8_000, 64) / 3600, rel=1e-9)
    assert "extrapolated to 8000" in est.formula


def test_the_prompt_length_is_an_upper_bound_where_one_is_recorded(tmp_path):
    figures = figures_file(tmp_path / "f.json", {**HF_4B, **VLLM_4B})
    # 40000 tokens: 106000 (at least as long), not the nearer 36000
    est = estimate(Workload("generate", "qwen3-4b", 16, 40_000, 6_000), figures)
    assert est.keys == ("sampling.vllm.qwen3-4b.p106000.b16.n256.wall_s",
                        "sampling.vllm.qwen3-4b.p106000.b16.n6000.wall_s")
    assert est.gpu_hours == pytest.approx(16 * 1800.0 / 16 / 3600, rel=1e-9)
    assert "106000-token prompts" in est.formula and "an upper bound" in est.formula
    # longer than every recorded prompt: the longest, said to be shorter than the work's
    est = estimate(Workload("generate", "qwen3-4b", 16, 200_000, 6_000), figures)
    assert est.keys[0] == "sampling.vllm.qwen3-4b.p106000.b16.n256.wall_s"
    assert "shorter than the work's 200000 tokens: a lower bound" in est.formula


def test_an_engine_without_two_new_token_counts_is_passed_over_and_said(tmp_path):
    one_count = {"sampling.vllm.qwen3-4b.p36000.b16.n6000.wall_s": 100.0}
    figures = figures_file(tmp_path / "f.json", {**HF_4B, **one_count, **HF_BATCHED_4B})
    est = estimate(Workload("generate", "qwen3-4b", 150, 30_000, 6_000), figures)
    assert est.keys[0].startswith("sampling.hf_batched.qwen3-4b.p36000.b8.")
    assert est.gpu_hours == pytest.approx(150 * 2.0 / 8 / 3600, rel=1e-9)
    # neither batched engine usable: the HF backend at batch 1, saying why vLLM was passed over
    figures = figures_file(tmp_path / "g.json", {**HF_4B, **one_count})
    est = estimate(Workload("generate", "qwen3-4b", 150, 30_000, 6_000), figures)
    assert est.keys == ("generate.qwen3-4b.p36000.prefill_s", "generate.qwen3-4b.p36000.decode_per_token_s")
    assert est.gpu_hours == pytest.approx(150 * (1.5 * 30_000 / 36_000 + 6_000 * 0.1) / 3600, rel=1e-9)
    assert "HF backend, batch 1" in est.formula and "no batch is recorded at two new-token counts" in est.formula


def test_smollm3_is_costed_from_its_own_figures_first_then_a_larger_models_as_a_bound(tmp_path):
    hf_smol = {"generate.smollm3-3b.p36000.prefill_s": 0.8, "generate.smollm3-3b.p36000.decode_per_token_s": 0.12}
    smol_batched = {"sampling.hf_batched.smollm3-3b.p36000.b8.n256.wall_s": 40.0,
                    "sampling.hf_batched.smollm3-3b.p36000.b8.n6000.wall_s": 960.0}
    work = Workload("generate", "smollm3-3b", 150, 30_000, 6_000)
    # its own batched figures come before Qwen3-4B's, whatever the engine
    est = estimate(work, figures_file(tmp_path / "f.json", {**hf_smol, **VLLM_4B, **smol_batched}))
    assert est.keys == ("sampling.hf_batched.smollm3-3b.p36000.b8.n256.wall_s",
                        "sampling.hf_batched.smollm3-3b.p36000.b8.n6000.wall_s")
    assert est.gpu_hours == pytest.approx(150 * 960.0 / 8 / 3600, rel=1e-9)
    # no batched figure of its own: the larger Qwen3-4B's vLLM figures, named as an upper bound,
    # before its own HF figures at batch 1
    est = estimate(work, figures_file(tmp_path / "g.json", {**hf_smol, **VLLM_4B, **HF_BATCHED_4B}))
    assert est.keys[0].startswith("sampling.vllm.qwen3-4b.")
    assert "qwen3-4b's figures stand for smollm3-3b: an upper bound" in est.formula
    assert est.gpu_hours == estimate(dataclasses.replace(work, model="qwen3-4b"),
                                     figures_file(tmp_path / "g2.json", VLLM_4B)).gpu_hours
    # no batched figure of either: its own HF figures at batch 1
    est = estimate(work, figures_file(tmp_path / "h.json", {**hf_smol, **HF_4B}))
    assert est.keys == ("generate.smollm3-3b.p36000.prefill_s", "generate.smollm3-3b.p36000.decode_per_token_s")
    # a model without a stand-in is never costed from another's figures: no estimate
    assert estimate(dataclasses.replace(work, model="qwen3-14b"),
                    figures_file(tmp_path / "i.json", {**HF_4B, **VLLM_4B})).gpu_hours is None
    # its own vLLM figures, once recorded, come first
    smol_vllm = {k.replace("qwen3-4b", "smollm3-3b"): v for k, v in VLLM_4B.items()}
    est = estimate(work, figures_file(tmp_path / "j.json", {**hf_smol, **smol_vllm, **smol_batched}))
    assert est.keys[0] == "sampling.vllm.smollm3-3b.p36000.b64.n256.wall_s"


def test_evaluate_adds_its_readouts_and_own_heads_its_own_traces(tmp_path):
    readout = {"instrument.qwen3-4b.prefill_s": 2.0, "instrument.qwen3-4b.tokens": 30_000,
               "instrument.qwen3-4b.attribution_pass_s": 6.0}
    figures = figures_file(tmp_path / "f.json", {**VLLM_4B, **readout})
    sampling = estimate(Workload("generate", "qwen3-4b", 150, 30_000, 6_000), figures).gpu_hours
    ev = estimate(Workload("evaluate", "qwen3-4b", 150, 30_000, 6_000), figures)
    assert ev.gpu_hours == pytest.approx(sampling + 150 * 2.0 * 36_000 / 30_000 / 3600, rel=1e-9)
    assert "the readouts' forward" in ev.formula and "instrument.qwen3-4b.prefill_s" in ev.keys
    own = estimate(Workload("own_heads", "qwen3-4b", 150, 36_000, 6_000, sampler="qwen3-4b"), figures)
    passes = estimate(Workload("own_heads", "qwen3-4b", 150, 36_000), figures).gpu_hours
    assert passes == pytest.approx(150 * 6.0 * 36_000 / 30_000 / 3600, rel=1e-9)
    assert own.gpu_hours == pytest.approx(passes + sampling, rel=1e-9)
    # SmolLM3-3B's readouts: Qwen3-4B's forward, named as an upper bound
    smol = estimate(Workload("evaluate", "smollm3-3b", 150, 30_000, 6_000), figures)
    assert smol.gpu_hours == pytest.approx(ev.gpu_hours, rel=1e-9) and "stands for smollm3-3b" in smol.formula


ONPOLICY_4B = {"onpolicy_step.qwen3-4b.opd_step_s": 16.0, "onpolicy_step.qwen3-4b.gold_on_policy_step_s": 15.0,
               "onpolicy_step.qwen3-4b.gold_off_policy_step_s": 25.0,
               "onpolicy_step.qwen3-4b.opd_rollout_tokens": 256}
VLLM_STEPS_4B = {"onpolicy_step.qwen3-4b.opd_step_vllm_s": 6.0,
                 "onpolicy_step.qwen3-4b.gold_on_policy_step_vllm_s": 5.0}


def test_on_policy_steps_with_vllm_rollouts_are_costed_from_their_own_figures(tmp_path):
    figures = figures_file(tmp_path / "f.json", {**HF_4B, **VLLM_4B, **ONPOLICY_4B, **VLLM_STEPS_4B})
    per_token = (200.0 - 10.0) / (6000 - 256)  # vLLM at batch 1, 36000-token prompts
    est = estimate(Workload("train_opd", "qwen3-4b", 986, 36_000, 6_000), figures)
    assert est.gpu_hours == pytest.approx(986 * (6.0 + 5_744 * per_token) / 3600, rel=1e-9)
    assert est.keys == ("onpolicy_step.qwen3-4b.opd_step_vllm_s", "onpolicy_step.qwen3-4b.opd_rollout_tokens",
                        "sampling.vllm.qwen3-4b.p36000.b1.n256.wall_s",
                        "sampling.vllm.qwen3-4b.p36000.b1.n6000.wall_s")
    assert "vLLM" in est.formula and "batch-1" in est.formula
    # GOLD: the on-policy share with vLLM rollouts, the off-policy steps as measured
    est = estimate(Workload("train_gold", "qwen3-4b", 493, 36_000, 6_000, 0.5), figures)
    assert est.gpu_hours == pytest.approx(493 * (0.5 * (5.0 + 5_744 * per_token) + 0.5 * 25.0) / 3600, rel=1e-9)
    assert "onpolicy_step.qwen3-4b.gold_off_policy_step_s" in est.keys
    assert "onpolicy_step.qwen3-4b.gold_on_policy_step_vllm_s" in est.keys
    # a rollout within the measured cap needs no time per token
    est = estimate(Workload("train_opd", "qwen3-4b", 10, 36_000, 256),
                   figures_file(tmp_path / "g.json", {**ONPOLICY_4B, **VLLM_STEPS_4B}))
    assert est.gpu_hours == pytest.approx(10 * 6.0 / 3600, rel=1e-9)
    # no vLLM step recorded: through HF generation, as before
    hf = figures_file(tmp_path / "h.json", {**HF_4B, **VLLM_4B, **ONPOLICY_4B})
    est = estimate(Workload("train_opd", "qwen3-4b", 986, 36_000, 6_000), hf)
    assert est.gpu_hours == pytest.approx(986 * (16.0 + 5_744 * 0.1) / 3600, rel=1e-9)
    assert "HF generation" in est.formula and "onpolicy_step.qwen3-4b.opd_step_s" in est.keys
    # the vLLM step without vLLM's time per token: through HF generation, saying why
    est = estimate(Workload("train_opd", "qwen3-4b", 986, 36_000, 6_000),
                   figures_file(tmp_path / "i.json", {**HF_4B, **ONPOLICY_4B, **VLLM_STEPS_4B}))
    assert est.gpu_hours == pytest.approx(986 * (16.0 + 5_744 * 0.1) / 3600, rel=1e-9)
    assert "opd_step_vllm_s not used" in est.formula


def test_the_tree_subtotals_sum_to_the_total(tmp_path):
    from mistill.runbook import subtotals

    for figures in (Figures.load(), figures_file(tmp_path / "f.json", {**Figures.load().values, **VLLM_4B})):
        plan = paper_plan()
        trees = subtotals(plan, figures)
        assert list(trees) == ["HD-001", "HD-002", "instruction", "DT-000", "DT-001", "M2", "EF", "ST", "EU", "BC",
                               "MQ", "MP", "PP", "LC", "report"]
        estimates = [estimate(s.work, figures) for s in plan]
        total = sum(e.gpu_hours for e in estimates if e.gpu_hours is not None)
        assert sum(t.gpu_hours for t in trees.values()) == pytest.approx(total, rel=1e-12)
        assert sum(t.steps for t in trees.values()) == len(plan)
        assert sum(t.without_figure for t in trees.values()) == sum(e.gpu_hours is None for e in estimates)
        text = render(plan, figures, by_entry_point=True)
        lines = text.splitlines()
        at = lines.index("GPU-hours by tree:")
        n = len(trees)
        assert [ln.split()[0] for ln in lines[at + 1:at + 1 + n]] == list(trees)
        printed = sum(float(ln.split()[1]) for ln in lines[at + 1:at + 1 + n])
        assert printed == pytest.approx(total, abs=0.005 * n + 0.001)  # subtotals rounded to 0.01 each
        assert lines.index("GPU-hours by entry point:") > at + n
        assert f"{total:.1f} GPU-hours" in text
        transfer = sum(t.gpu_hours for name, t in trees.items() if name in TRANSFER_TREES)
        assert f"of which the main reproduction {total - transfer:.1f} and the trees priced apart " \
               f"(EF, ST, M2, EU, BC, MQ, MP, PP, LC) " \
               f"{transfer:.1f}" in text
        by_entry = subtotals(plan, figures, "entry_point")
        assert sum(t.gpu_hours for t in by_entry.values()) == pytest.approx(total, rel=1e-12)


def test_the_command_takes_all_results_and_refuses_an_unknown_id_in_one_line(capsys):
    from mistill.runbook import main

    main([])
    every = capsys.readouterr().out
    main(["--results", "all"])
    assert capsys.readouterr().out == every
    assert f"{len(paper_plan())} steps" in every and "GPU-hours by tree:" in every
    for results in ("R-Z9", "all,R-Z9"):
        with pytest.raises(SystemExit) as exit_:
            main(["--results", results])
        assert exit_.value.code == 2
        captured = capsys.readouterr()
        assert captured.out == "" and "Traceback" not in captured.err
        assert captured.err.startswith("python -m mistill.runbook: unknown result ids R-Z9")
        assert len(captured.err.strip().splitlines()) == 1


def test_the_command_reads_a_figures_file(tmp_path, capsys):
    from mistill.runbook import main

    path = tmp_path / "f.json"
    figures_file(path, {**Figures.load().values, **VLLM_4B})
    main(["--results", "R-D4", "--figures", str(path)])
    out = capsys.readouterr().out
    assert "measured: vllm, batch 64" in out and str(path) in out
    with pytest.raises(SystemExit) as exit_:
        main(["--figures", str(tmp_path / "missing.json")])
    assert exit_.value.code == 2 and "cannot read the benchmark figures" in capsys.readouterr().err


def test_the_recorded_figures_cost_every_step_of_the_paper_plan_within_the_budget():
    """The reproduction's dry run: each of the plan's steps costed from a figure recorded in
    benchmarks/results.json, and the main reproduction (every tree but those priced apart) at
    most 200 H200 GPU-hours; the trees priced apart at most 210 (the evidence-flip tree about 64,
    its eleven causal HF runs costed from H100 figures of the compiled masked path; App. O's
    MuSiQue-Ans tree about 43 and its evidence pairs with the teacher's gate about 19, the gate's
    prefill-inclusive runs uncompiled; App. M.2's matched selection about 32, App. P's programming
    pilot about 20, App. M.5's learning curve about 4)."""
    figures = Figures.load()
    plan = paper_plan()
    estimates = {s.name: estimate(s.work, figures) for s in plan}
    uncosted = sorted(name for name, e in estimates.items() if e.gpu_hours is None)
    assert not uncosted, uncosted[:5]
    for name, e in estimates.items():
        assert e.gpu_hours == 0.0 or all(k in figures.values for k in e.keys), name
    main = sum(estimates[s.name].gpu_hours for s in plan if s.tree not in TRANSFER_TREES)
    transfer = sum(estimates[s.name].gpu_hours for s in plan if s.tree in TRANSFER_TREES)
    assert main <= 200.0 and 0 < transfer <= 210.0


def test_the_learning_curve_trains_both_arms_at_each_smaller_size_and_evaluates_them_on_the_test_notes():
    """App. M.5 (R-D8): seed 0 of Vanilla CoT-KD and Mistill, bf16, on 100 and 250 training notes
    (note seed 0), each evaluated on the test notes; Vanilla CoT-KD at 100 notes is the selection's
    reference run of DT-001, and Mistill trains at the bf16 selection's lambda."""
    from mistill.runbook import result_trees, select

    plan = {s.name: s for s in paper_plan()}
    lc = {n: s for n, s in plan.items() if s.tree == "LC"}
    evaluated = {s.inputs["train_run"] for s in lc.values() if s.entry_point == "evaluate"}
    assert evaluated == {"DT-001/train_qwen3-4b_vanilla-bf16_n100_s0", "LC/train_qwen3-4b_mistill_n100_s0",
                         "LC/train_qwen3-4b_vanilla-bf16_n250_s0", "LC/train_qwen3-4b_mistill_n250_s0"}
    for name in evaluated:
        train = plan[name]
        assert (train.params["train_notes"], train.params["train_notes_seed"], train.params["seed"]) in \
            {("100", "0", "0"), ("250", "0", "0")}
        assert train.params["arm"] in ("mistill", "vanilla-bf16")
        assert ("DT-001/select_lambda" in train.needs) == (train.params["arm"] == "mistill")
    assert {s.params["split"] for s in lc.values() if s.entry_point == "evaluate"} == {"test"}
    assert result_trees("R-D8") == ("DT-000", "DT-001", "LC", "report")
    picked = {s.name for s in select(list(plan.values()), ["R-D8"])}
    assert set(lc) <= picked and "DT-001/evaluate_qwen3-4b_mistill_s0" in picked


def test_the_behavioural_half_of_the_flip_test_reads_the_papers_fourteen_checkpoints():
    """App. N (Table 54): the teacher, three seeds of each locked pair (bf16 and fp32 Mistill and
    Vanilla CoT-KD) and, descriptive, the matched-selection RandHeads pick of tree M2, all sampled
    through the stages' engine on one frozen cohort."""
    plan = paper_plan()
    names = [s.name for s in plan]
    behaviour = {s.name: s for s in plan if s.entry_point == "flip_test" and s.tree == "EF"
                 and "backend" not in s.params}
    assert len(behaviour) == 14 and all(s.inputs["cohort_run"] == "EF/flip_cohort" for s in behaviour.values())
    reads = {s.inputs.get("train_run", s.params.get("arm")) for s in behaviour.values()}
    want = {f"{tree}/train_qwen3-4b_{arm}_s{seed}" for arm, tree in (("mistill", "DT-001"), ("vanilla-bf16", "DT-000"),
                                                                      ("mistill-fp32", "DT-001"),
                                                                      ("vanilla-fp32", "DT-000")) for seed in range(3)}
    assert reads == want | {"teacher", "M2/train_qwen3-4b_m2-randheads_s0"}
    pick = "EF/flip_test_qwen3-4b_m2-randheads_s0"
    assert names.index("M2/train_qwen3-4b_m2-randheads_s0") < names.index(pick)


def test_the_causal_half_of_the_flip_test_runs_each_checkpoint_clean_and_under_both_masks():
    """App. N.4: the teacher on its named pair and its own top-40, each bf16 seed-0 student on its own
    top-40 (its own_heads step's ranking); a clean HF run of each checkpoint; every run on the HF path,
    costed on that path; the named pair's steps are skipped on a synthetic corpus."""
    plan = {s.name: s for s in paper_plan()}
    causal = {n: s for n, s in plan.items() if s.entry_point == "flip_test" and s.params.get("backend") == "hf"
              and s.tree == "EF"}  # App. O's gate (tree MP) is read in its own test
    runs = {"teacher": "teacher", "qwen3-4b_mistill_s0": "DT-001", "qwen3-4b_vanilla-bf16_s0": "DT-000"}
    want = {f"EF/flip_test_{r}_hf" for r in runs}
    want |= {f"EF/flip_test_{r}_{m}_top40" for r in runs for m in ("target", "sham")}
    want |= {f"EF/flip_test_teacher_{m}_pair" for m in ("target", "sham")}
    assert set(causal) == want
    for name, step in causal.items():
        masked = not name.endswith("_hf")
        assert step.work.engine == ("hf_masked" if masked else "hf_batched"), name
        assert step.params.get("mask", "") == (name.split("_")[-2] if masked else ""), name
        assert step.skip_synthetic == name.endswith("_pair"), name
    assert plan["EF/flip_test_teacher_target_pair"].params["mask_heads"] == "L30H11,L38H39"
    assert plan["EF/flip_test_teacher_sham_top40"].inputs["mask_heads_run"] == "DT-000/teacher_attribute:attribute"
    for run, tree in list(runs.items())[1:]:
        step = plan[f"EF/flip_test_{run}_target_top40"]
        assert step.inputs == {"cohort_run": "EF/flip_cohort", "train_run": f"{tree}/train_{run}",
                               "mask_heads_run": f"{tree}/own_heads_{run}"}
        assert (step.params["mask_k"], step.params["mask_phase"]) == ("40", "P2C")


def test_the_teachers_evidence_mask_gate_masks_its_top_40_from_the_prefill_on():
    """App. O's gate (Table 58): the teacher on the evidence pairs clean on the HF path, then its MQ
    answer-emission top-40 under the prefill-inclusive sham and target masks, and three
    layer-matched random draws under the target mask; every masked run costed on the masked path
    uncompiled, as the prefill-inclusive regime runs."""
    plan = {s.name: s for s in paper_plan()}
    gate = {n: s for n, s in plan.items() if n.startswith("MP/gate_")}
    assert set(gate) == {f"MP/gate_{x}" for x in ("clean", "sham", "target", "random1", "random2", "random3")}
    assert "mask" not in gate["MP/gate_clean"].params and gate["MP/gate_clean"].work.engine == "hf_batched"
    for name, step in gate.items():
        assert (step.params["arm"], step.params["backend"], step.inputs["cohort_run"]) == ("teacher", "hf",
                                                                                           "MP/flip_cohort")
        if name == "MP/gate_clean":
            continue
        assert step.work.engine == "hf_masked_eager"
        assert step.inputs["mask_heads_run"] == "MQ/teacher_attribute:attribute"
        assert (step.params["mask_regime"], step.params["mask_phase"], step.params["mask_k"]) == ("prefill", "P2", "40")
        draw = name.removeprefix("MP/gate_")
        assert step.params["mask"] == ("sham" if draw == "sham" else "target")
        assert step.params.get("mask_random", "0") == (draw.removeprefix("random") if "random" in draw else "0")
    assert set(gate) <= set(plan["MP/report"].needs)


def test_a_step_pinned_to_one_path_reads_that_path_or_a_slower_ones_figures(tmp_path):
    """A masked run is costed from the masked path's figures, never vLLM's; a clean HF run without
    figures of its own from the masked path's, said to be an upper bound; a path without any figure
    falls back to the HF backend at batch 1, naming what is missing; an unknown path is refused."""
    walls = {"sampling.hf_masked.qwen3-4b.p30000.b8.n32.wall_s": 20.0,
             "sampling.hf_masked.qwen3-4b.p30000.b8.n160.wall_s": 30.0,
             "sampling.vllm.qwen3-4b.p30000.b8.n32.wall_s": 1.0,
             "sampling.vllm.qwen3-4b.p30000.b8.n160.wall_s": 2.0}
    figures = figures_file(tmp_path / "f.json", {**hf_only(tmp_path).values, **walls})
    masked = Workload("generate", "qwen3-4b", 16, 30000, 96, engine="hf_masked")
    got = estimate(masked, figures)
    assert got.gpu_hours == pytest.approx(16 * 25.0 / 8 / 3600) and "measured: hf_masked, batch 8" in got.formula
    assert estimate(dataclasses.replace(masked, engine=""), figures).gpu_hours == pytest.approx(16 * 1.5 / 8 / 3600)
    clean = estimate(dataclasses.replace(masked, engine="hf_batched"), figures)
    assert clean.gpu_hours == got.gpu_hours and "hf_masked's figures stand for hf_batched: an upper bound" in clean.formula
    bare = estimate(dataclasses.replace(masked, engine="hf_batched"), hf_only(tmp_path))
    assert "HF backend, batch 1" in bare.formula and "sampling.hf_batched.qwen3-4b.* is not recorded" in bare.formula
    with pytest.raises(ValueError, match="unknown sampling path"):
        estimate(dataclasses.replace(masked, engine="tensorrt"), figures)


def test_a_warm_up_recorded_beside_the_walls_adds_the_compilation_once(tmp_path):
    """Walls timed after ``bench_sampling.py --warmup`` hold no compilation: the estimate adds it
    once per run, the warm-up (the largest count at its largest batch) less that run's timed wall,
    and names both figures; without a warm-up figure nothing is added."""
    walls = {"sampling.hf_masked.qwen3-4b.p30000.b8.n32.wall_s": 20.0,
             "sampling.hf_masked.qwen3-4b.p30000.b8.n160.wall_s": 30.0,
             "sampling.hf_masked.qwen3-4b.p30000.b4.n160.wall_s": 25.0}
    work = Workload("generate", "qwen3-4b", 16, 30000, 96, engine="hf_masked")
    plain = estimate(work, figures_file(tmp_path / "a.json", {**hf_only(tmp_path).values, **walls}))
    warm = "sampling.hf_masked.qwen3-4b.p30000.warmup_s"
    got = estimate(work, figures_file(tmp_path / "b.json", {**hf_only(tmp_path).values, **walls, warm: 130.0}))
    assert got.gpu_hours == pytest.approx(plain.gpu_hours + (130.0 - 30.0) / 3600)
    assert "+ 100 s compiling the decode step once" in got.formula and "compiling" not in plain.formula
    assert {warm, "sampling.hf_masked.qwen3-4b.p30000.b8.n160.wall_s"} <= set(got.keys)


def test_table22_characterizes_every_edited_checkpoint_and_edits_its_traces():
    """ST: each checkpoint Table 22 reads gets events on the test notes with its train step's
    checkpoint as the model, an attribute pass on them and the trace edits with its own mediation
    heads; the 4B passes without a figure of their own are bounded by the teacher's, said so; the
    report waits for the edits."""
    from mistill.runbook import STUDENT_EDITS

    figures = Figures.load()
    plan = {s.name: s for s in paper_plan()}
    tree = [s for s in plan.values() if s.tree == "ST"]
    checkpoints = [f"{st}_{arm}_s{seed}" for st, arm, _, seeds in STUDENT_EDITS for seed in range(seeds)]
    assert len(checkpoints) == 19 and len(tree) == 3 * len(checkpoints)
    for (student, arm, trained_in, seeds) in STUDENT_EDITS:
        for seed in range(seeds):
            run = f"{student}_{arm}_s{seed}"
            events = plan[f"ST/events_{run}"]
            assert events.model_run == f"{trained_in}/train_{run}" and events.model_run in plan
            assert events.model_run in events.needs and events.params == {"split": "test"}
            assert plan[f"ST/attribute_{run}"].inputs == {"events_run": f"ST/events_{run}"}
            edit = plan[f"ST/trace_edit_{run}"]
            assert edit.inputs == {"attribute_run": f"ST/attribute_{run}"} and "mediation_heads" not in edit.params
            assert edit.name in plan["report/report"].needs
            cost = estimate(edit.work, figures)
            assert cost.gpu_hours > 0 and "qwen3-14b's figure stands for qwen3-4b's: an upper bound" in cost.formula
