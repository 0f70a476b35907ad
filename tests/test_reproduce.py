"""``reproduce``: the paper's trees as parent runs of nested, reused steps; a dry run (the default
when a path is missing) that prints the plan and creates nothing; resume after a failed step."""

from __future__ import annotations

import uuid

import pytest
from mlflow.tracking import MlflowClient

from mistill.distill.arms import resolve_arm
from mistill.runbook import OWN_LAMBDA_ARMS, paper_plan, select
from mistill.stages.reproduce import (ReproduceConfig, TAG_TREE, ids_from_tags, load_settings, missing_roles,
                                      run_reproduce, step_config, step_tags)
from stage_fixtures import TINY, unique

pytestmark = pytest.mark.usefixtures("pinned_code_version")

EMBEDDED = dict(corpus="synthetic", teacher="embedded:smollm2-135m", student="embedded:smollm2-135m@every-other",
                student_smollm3="embedded:smollm2-135m@every-other", encoder="embedded:all-minilm-l6-v2",
                las_model="embedded:smollm2-135m", device="cpu", dtype="float32",
                settings="projects/configs/reproduce/smoke.yaml")
"""The smoke settings' roles: the embedded default in every part."""

TINY_SETTINGS = """
prepare: {n_notes: 3, select_n: 0}
characterize: {n_null: 4, selftest_events: 0, k_bins: [3, 8], events_per_phase: 3, stability_splits: 5}
"""


def test_every_step_of_the_plan_builds_a_valid_config_from_the_roles(tmp_path):
    """On the embedded roles and the smoke settings each step's config validates, its inputs are
    the runs of the steps it names and its roles are filled in (the EURLEX tree's from the
    project's fixture of the release); a Mistill arm waits for the selection's λ."""
    from mistill.tasks.eurlex import write_eurlex_fixture
    from mistill.tasks.bigcodebench import write_bigcodebench_fixture
    from mistill.tasks.kodcode import write_kodcode_fixture
    from mistill.tasks.musique import write_musique_fixture

    release = write_eurlex_fixture(tmp_path / "eurlex")
    musique = write_musique_fixture(tmp_path / "musique")
    code = write_bigcodebench_fixture(tmp_path / "bigcodebench")
    kodcode = write_kodcode_fixture(tmp_path / "kodcode")
    pair_files = {role: tmp_path / name for role, name in (("musique_pair_proposals", "pairs.jsonl"),
                                                           ("musique_pair_ledger", "pairs-ledger.csv"))}
    for path in pair_files.values():
        path.write_text("")
    cfg = ReproduceConfig(**EMBEDDED, eurlex_dataset=str(release["dataset"]),
                          eurlex_concepts=str(release["concepts_file"]),
                          eurlex_hierarchy=str(release["hierarchy_file"]), musique_release=str(musique["corpus"]),
                          bigcodebench_file=str(code["corpus"]), kodcode_file=str(kodcode["corpus"]),
                          **{role: str(path) for role, path in pair_files.items()})
    settings = load_settings(cfg.settings)
    plan = paper_plan()
    ids = {s.name: uuid.uuid4().hex for s in plan}
    ids.update({f"{s.name}:{n}": uuid.uuid4().hex for s in plan for n in ("events", "attribute", "knockin")})
    for selection in ("DT-001/select_lambda", "DT-001/select_lambda_fp32", "MQ/select_lambda_mistill",
                      "MQ/select_lambda_randheads", "M2/select_lambda_mistill", "M2/select_lambda_randheads"):
        del ids[selection]
    assert missing_roles(plan, cfg) == []
    for step in plan:
        config = step_config(step, cfg, ids, settings)
        if step.entry_point == "train" and resolve_arm(step.params["arm"]).objective == "mistill" \
                and step.params["arm"] not in OWN_LAMBDA_ARMS and "overrides" not in step.params:
            assert config is None  # no selection run yet
            continue
        assert config is not None, step.name
        for field, refs in step.inputs.items():
            value = getattr(config, field)
            want = [ids[ref] for ref in refs.split(",")]
            assert value == (want[0] if isinstance(value, str) else tuple(want)), (step.name, field)
        if step.model_run:  # a trained student's checkpoint is the model
            assert config.model == f"run:{ids[step.model_run]}", step.name
        if step.name == "EF/flip_cohort":  # the synthetic cases stand for the author's files
            assert config.synthetic_cases and not config.proposals and not config.ledger
            assert config.lock.endswith("ef-cohort-embedded.yaml")
        if step.name == "DT-000/train_smollm3-3b_gold_s0":
            assert config.student == EMBEDDED["student_smollm3"] and config.arm == "gold"
        if step.name == "EU/prepare":
            assert config.task == "eurlex57k" and config.concepts_file == str(release["concepts_file"])
        if step.name == "EU/read_side_fresh":
            assert (config.panel_top, config.panel_bottom, config.panel_random) == (40, 40, 40)
        if step.name == "HD-001/characterize":
            assert config.model == EMBEDDED["teacher"] and config.n_null == 10 and config.device == "cpu"
        if step.name == "MQ/prepare":  # App. O's splits, in an experiment of the tree's own
            assert config.task == "musique" and config.split_sizes == (2000, 102, 1203, 1610)
            assert config.corpus == str(musique["corpus"]) and config.corpus_name.endswith("-musique")
        if step.name == "MQ/evaluate_vanilla-bf16_s2":  # answers only, on the evaluation questions
            assert (config.split, config.fidelity, config.arm) == ("test", False, "vanilla-bf16")
        if step.name == "MQ/own_heads_mistill_s1":  # ranked and read on the ranking questions
            assert (config.rank_split, config.test_split) == ("val", "val")
        if step.name == "BC/prepare":  # the ranking, assessment and fresh batches, in an experiment of its own
            assert config.task == "bigcodebench" and config.split_sizes == (120, 60, 100)
            assert config.corpus_name.endswith("-bigcodebench")
        if step.name == "PP/prepare":  # App. P's pilot: KodCode's locked split, in an experiment of its own
            assert config.task == "kodcode" and config.split_sizes == (2000,)
            assert config.corpus == str(kodcode["corpus"]) and config.corpus_name.endswith("-programming-pilot")
        if step.name == "PP/targets":  # the training problems' events, the teacher's ranking frozen on BC's batches
            assert (config.events_run, config.sets_run) == (ids["PP/events"], ids["BC/attribute_rank"])
        if step.name == "PP/train_mistill_s1":  # λ fixed at 0.01, no selection
            assert config.overrides == "lambda_p1=0.01,lambda_p2=0.01" and config.seed == 1
        if step.name == "PP/own_heads_randheads_s0":  # ranked on the ranking batches, read on the assessment batch
            assert (config.rank_split, config.test_split, config.k, config.own_traces) == ("train", "val", (29, 40),
                                                                                            False)
        if step.name == "PP/evaluate_vanilla-bf16_s1":  # pass@1 on the 180 development tasks
            assert config.split == "test" and not config.fidelity
        if step.name == "MP/prepare":  # MQ's splits and the evidence pairs' slice of the dev file
            assert config.split_sizes == (2000, 102, 1203, 1610, 807) and config.corpus_name.endswith("-musique")
        if step.name == "MP/flip_cohort":  # the author's pairs under App. O's lock
            assert (config.proposals, config.ledger) == tuple(str(p) for p in pair_files.values())
            assert config.lock.endswith("o-musique-pairs.yaml") and config.prepare_run == ids["MP/generate"]
        if step.name == "MP/flip_test_randheads_s2":  # each MQ checkpoint on every pair
            assert (config.train_run, config.samples) == (ids["MQ/train_randheads_s2"], 4)
        if step.name == "MP/gate_random2":  # the teacher's gate: a layer-matched draw under the prefill mask
            assert (config.mask, config.mask_regime, config.mask_random, config.mask_phase, config.mask_k) == \
                ("target", "prefill", 2, "P2", 40)
            assert config.mask_heads_run == ids["MQ/teacher_attribute:attribute"] and config.backend == "hf"
        if step.entry_point == "prepare" and step.tree not in ("EU", "BC", "MQ", "MP", "PP"):  # they read the releases
            assert config.select_n == 0 and config.corpus == "synthetic"  # the smoke settings over the plan
        if step.name == "DT-001/train_qwen3-4b_low-lambda_s0":
            assert (config.overrides, resolve_arm(config.arm).lambda_p1) == ("", 0.03)  # its own λ
        if step.name.startswith("DT-001/train_qwen3-4b_vanilla-bf16_n100_"):
            assert config.train_notes == 0 and config.train_notes_seed == 0  # the smoke lock's notes


def test_a_missing_path_makes_a_dry_run_that_creates_nothing(tracking_uri, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path))
    name = unique("repro-dry")
    cfg = ReproduceConfig(teacher="/absent/models/qwen3-14b", corpus="mimic:/absent/mimic/notes.csv",
                          corpus_name=name, results=("R-C3",))
    assert missing_roles(select(paper_plan(), cfg.results), cfg) == ["teacher", "corpus"]
    assert run_reproduce(cfg) == ""
    out = capsys.readouterr().out
    assert out.startswith("dry run: missing or empty teacher") and "corpus (mimic:" in out
    assert "HD-001/characterize" in out and "GPU-hours" in out and "DT-000" not in out
    assert MlflowClient().get_experiment_by_name(f"mistill/{name}") is None
    # the evidence-flip tree needs the author's proposals and the reviewer's ledger on a real corpus
    flips = ReproduceConfig(teacher="/absent/models/qwen3-14b", corpus="mimic:/absent/mimic/notes.csv",
                            corpus_name=name, results=("R-D33",))
    assert {"flip_proposals", "flip_ledger"} <= set(missing_roles(select(paper_plan(), flips.results), flips))
    assert "flip_proposals" not in missing_roles(select(paper_plan(), flips.results),
                                                 ReproduceConfig(**EMBEDDED, results=("R-D33",)))


def _runs(exp_name: str) -> list:
    client = MlflowClient()
    exp = client.get_experiment_by_name(exp_name)
    return [] if exp is None else client.search_runs([exp.experiment_id], max_results=1000)


def test_a_tree_runs_nested_under_its_run_resumes_and_is_reused(tracking_uri, tmp_path, monkeypatch, capsys):
    """R-C3 on tiny models: the HD-001 tree's run holds prepare and the nested characterization
    (generate is not run on the synthetic corpus). A failure part-way leaves the finished steps
    tagged; the same command resumes the same runs without redoing them; once finished, it is
    reused whole, and a dry run names the runs it would reuse."""
    import mistill.stages.reproduce as reproduce

    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path))
    settings = tmp_path / "tiny.yaml"
    settings.write_text(TINY_SETTINGS)
    name = unique("repro")
    cfg = ReproduceConfig(corpus="synthetic", corpus_name=name, teacher=TINY, device="cpu", dtype="float32",
                          launch="inline", settings=str(settings), results=("R-C3",))
    real = reproduce.run_plan_step

    def fail_characterize(step, *args, **kwargs):
        if step.entry_point == "characterize":
            raise RuntimeError("stopped")
        return real(step, *args, **kwargs)

    monkeypatch.setattr(reproduce, "run_plan_step", fail_characterize)
    with pytest.raises(RuntimeError, match="stopped"):
        run_reproduce(cfg)
    (failed,) = [r for r in _runs(f"mistill/{name}") if r.data.tags.get("mistill.stage") == "reproduce"
                 and TAG_TREE not in r.data.tags]
    assert failed.info.status == "FAILED"
    (prepare,) = [r for r in _runs(f"mistill/{name}") if r.data.tags.get("mistill.stage") == "prepare"]
    assert ids_from_tags(failed.data.tags) == {"HD-001/prepare": prepare.info.run_id}

    monkeypatch.setattr(reproduce, "run_plan_step", real)
    run_id = run_reproduce(cfg)
    assert run_id == failed.info.run_id  # resumed, not started anew
    runs = _runs(f"mistill/{name}")
    by_stage: dict[str, list] = {}
    for r in runs:
        by_stage.setdefault(r.data.tags.get("mistill.stage"), []).append(r)
    assert [r.info.run_id for r in by_stage["prepare"]] == [prepare.info.run_id]  # not redone
    (tree,) = [r for r in by_stage["reproduce"] if r.data.tags.get(TAG_TREE) == "HD-001"]
    assert tree.info.run_name == "HD-001" and tree.data.tags["mlflow.parentRunId"] == run_id
    assert tree.info.status == "FINISHED"
    for stage in ("prepare", "events", "attribute", "knockin"):
        (step,) = by_stage[stage]
        assert step.data.tags["mlflow.parentRunId"] == tree.info.run_id, stage
        assert step.info.status == "FINISHED"
    assert "generate" not in by_stage  # the synthetic corpus carries the teacher's traces
    recorded = ids_from_tags(MlflowClient().get_run(run_id).data.tags)
    assert recorded["HD-001/characterize"] == by_stage["knockin"][0].info.run_id
    assert recorded["HD-001/characterize:attribute"] == by_stage["attribute"][0].info.run_id
    assert step_tags(recorded) == {k: v for k, v in MlflowClient().get_run(run_id).data.tags.items()
                                   if k.startswith("mistill.step.")}

    assert run_reproduce(cfg) == run_id  # finished: reused whole
    assert len(_runs(f"mistill/{name}")) == len(runs)

    capsys.readouterr()
    assert run_reproduce(cfg.replace(dry_run=True)) == ""
    out = capsys.readouterr().out
    assert f"[reuse {by_stage['knockin'][0].info.run_id}]" in out
    assert f"[reuse {prepare.info.run_id}]" in out and "[synthetic corpus: not run]" in out
    # the estimates at the lengths of the corpus found, not the paper's
    from mistill.runbook import prepared_counts

    counts = prepared_counts(prepare.info.run_id, sizes=False)
    assert f"lengths and split sizes from the corpora of HD-001/generate ({prepare.info.run_id})" in out
    assert f"x ({counts.full_prompt_tokens} / " in out and counts.full_prompt_tokens != 106_000
    assert len(_runs(f"mistill/{name}")) == len(runs)
