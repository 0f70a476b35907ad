"""The result index held against the reproduction plan: a result marked *produced* must have every
run that the paper's Appendix Q entry names (arms, students, seeds, the λ each trains at, the
models and note counts) among the steps ``reproduce`` runs for it.

``APP_Q_RUNS`` is the appendix read by hand, result by result (its "Seeds:" line and the text of
the entry); each value lists the plan's step names the result needs. A result marked produced with
no row here fails, so a promotion in the index has to state its runs first."""

from __future__ import annotations

import pytest

from mistill.results_index import load
from mistill.runbook import STUDENT_EDITS, PaperCounts, paper_plan, select
from selection.lock import load_lock

Q4B, SMOL = "qwen3-4b", "smollm3-3b"
BF16_SELECTION, FP32_SELECTION = "DT-001/select_lambda", "DT-001/select_lambda_fp32"


def edited(run: str) -> list[str]:
    """Table 22's steps of one checkpoint (tree ST): its events, attribute pass and trace edits."""
    return [f"ST/{stage}_{run}" for stage in ("events", "attribute", "trace_edit")]


def trained(student: str, arm: str, seeds: int, *, tree: str = "DT-001", evaluated: bool = True,
            own_heads: bool = True) -> list[str]:
    """The train steps of ``arm`` on ``student`` at seeds ``0..seeds-1`` and, per seed, its test
    evaluation and its own-heads readout."""
    out = []
    for seed in range(seeds):
        run = f"{student}_{arm}_s{seed}" if student else f"{arm}_s{seed}"  # MQ's runs name no student
        out.append(f"{tree}/train_{run}")
        if evaluated:
            out.append(f"{tree}/evaluate_{run}")
        if own_heads:
            out.append(f"{tree}/own_heads_{run}")
    return out


UNTRAINED = ["DT-000/evaluate_qwen3-4b_untrained", "DT-000/evaluate_smollm3-3b_untrained"]
UNTRAINED_HEADS = ["DT-000/own_heads_qwen3-4b_untrained", "DT-000/own_heads_smollm3-3b_untrained"]
HD001 = ["HD-001/prepare", "HD-001/generate", "HD-001/characterize"]
MAIN = (trained(Q4B, "vanilla-fp32", 3, tree="DT-000") + trained(SMOL, "vanilla-fp32", 2, tree="DT-000")
        + trained(Q4B, "mistill", 3) + trained(SMOL, "mistill", 3))

APP_Q_RUNS: dict[str, list[str]] = {
    # characterization: the teacher's 100 HD-001 notes (one trace each)
    "R-C1": HD001,
    "R-C2": HD001,
    "R-C3": HD001,
    "R-C4": HD001,
    "R-C5": [*HD001, "HD-001/read_side"],
    "R-C6": [*HD001, "HD-001/locus"],
    "R-C7": [*HD001, "HD-001/locus", "HD-001/read_side", "HD-002/shortlist", "HD-002/generate", "HD-002/characterize",
             "HD-002/locus", "HD-002/read_side"],
    "R-C8": ["HD-001/generate", "HD-001/events_50", "HD-001/attribute_50_intact", "HD-001/attribute_50_detached"],
    "R-C10": [*HD001, "HD-001/read_side", "HD-001/key_block"],
    "R-C11": [*HD001, "HD-001/trace_edit", "HD-001/note_edit"],
    "R-C12": [*HD001, "HD-001/locus"],
    "R-C13": [*HD001, "HD-001/read_side", "HD-001/locus"],
    "R-C14": ["instruction/prepare", "instruction/generate", "instruction/characterize",
              "instruction/knockin_hd001_sets", "instruction/locus"],
    # distillation
    "R-D0": ["DT-000/shortlist", "DT-000/generate", "DT-000/evaluate_teacher"],
    "R-D1": UNTRAINED,
    "R-D2": trained(Q4B, "vanilla-fp32", 3, tree="DT-000") + trained(SMOL, "vanilla-fp32", 2, tree="DT-000"),
    "R-D3": trained(Q4B, "feature-kd", 3, tree="DT-000") + trained(SMOL, "feature-kd", 1, tree="DT-000"),
    "R-D4": (trained(Q4B, "distillm2", 1, tree="DT-000") + trained(Q4B, "opd", 1, tree="DT-000")
             + trained(SMOL, "gold", 1, tree="DT-000")),
    "R-D5": trained(Q4B, "mistill", 3) + trained(SMOL, "mistill", 3) + trained(Q4B, "vanilla-bf16", 3, tree="DT-000"),
    "R-D6": MAIN + UNTRAINED_HEADS,
    "R-D7": (trained(Q4B, "randpos", 1) + trained(Q4B, "randheads", 1) + trained(Q4B, "randboth", 1)
             + trained(SMOL, "randpos", 1) + trained(SMOL, "randheads", 1)),
    # App. M.5: seed 0 of both arms at 100 and 250 notes (Vanilla CoT-KD at 100 is the selection's
    # reference run), beside the tier-1 rows at 493 (three seeds, bf16 and fp32 Vanilla CoT-KD)
    "R-D8": ([f"LC/{step}_{Q4B}_{arm}_n{n}_s0" for arm, n, step in
              (("mistill", 100, "train"), ("mistill", 250, "train"), ("vanilla-bf16", 250, "train"))]
             + [f"LC/evaluate_{Q4B}_{arm}_n{n}_s0" for arm in ("mistill", "vanilla-bf16") for n in (100, 250)]
             + [BF16_SELECTION, f"DT-001/train_{Q4B}_vanilla-bf16_n100_s0"]
             + trained(Q4B, "mistill", 3, own_heads=False)
             + trained(Q4B, "vanilla-bf16", 3, tree="DT-000", own_heads=False)
             + trained(Q4B, "vanilla-fp32", 3, tree="DT-000", own_heads=False)),
    # the cost per arm: train runs with and without the Mistill terms (their step timing)
    "R-D9": (trained(Q4B, "mistill", 1, evaluated=False, own_heads=False)
             + trained(Q4B, "vanilla-bf16", 1, tree="DT-000", evaluated=False, own_heads=False)),
    "R-D10": [BF16_SELECTION, *trained(Q4B, "write-term", 1),
              *trained(Q4B, "vanilla-bf16_n100", 3, own_heads=False)],
    "R-D12": MAIN + trained(SMOL, "randheads", 2) + trained(SMOL, "bottom40", 2) + trained(Q4B, "randheads", 3),
    "R-D13": (trained(Q4B, "bottom40", 1) + trained(Q4B, "top8", 1) + trained(Q4B, "top100", 1)
              + trained(SMOL, "bottom40", 2) + trained(SMOL, "top8", 1) + UNTRAINED_HEADS),
    "R-D14": [name for arm in ("p1-only", "p2-only", "attention-only", "interaction-only", "low-lambda")
              for name in trained(Q4B, arm, 1)],
    "R-D15": MAIN + UNTRAINED_HEADS,
    "R-D17": (trained(Q4B, "vanilla-bf16", 3, tree="DT-000") + trained(SMOL, "vanilla-bf16", 1, tree="DT-000")
              + trained(Q4B, "vanilla-fp32", 3, tree="DT-000") + trained(SMOL, "vanilla-fp32", 2, tree="DT-000")
              + trained(Q4B, "mistill-fp32-bf16-lambda", 3)),
    "R-D18": MAIN,
    "R-D19": (trained(Q4B, "mistill", 3) + trained(SMOL, "mistill", 3) + trained(Q4B, "vanilla-bf16", 3, tree="DT-000")
              + trained(SMOL, "vanilla-bf16", 1, tree="DT-000")),
    "R-D20": HD001,
    "R-D21": ["DT-000/shortlist"],
    "R-D22": [FP32_SELECTION, *trained(Q4B, "mistill-fp32", 1), "DT-001/own_heads_probe_qwen3-4b_mistill-fp32_s0",
              *trained(Q4B, "vanilla-fp32", 3, tree="DT-000")],
    "R-D23": trained(Q4B, "event-weighted-vanilla", 1),
    "R-D24": trained(Q4B, "uniform", 1),
    "R-D25": trained(Q4B, "no-window", 1),
    "R-D26": trained(Q4B, "randheads", 3),
    "R-D27": trained(SMOL, "mistill", 3) + UNTRAINED_HEADS,
    "R-D29": MAIN,
    "R-D28": [name for student, arm, tree, seeds in STUDENT_EDITS for seed in range(seeds)
              for name in (f"{tree}/train_{student}_{arm}_s{seed}", *edited(f"{student}_{arm}_s{seed}"))],
    "R-D30": (trained(Q4B, "mistill-fp32", 3) + trained(Q4B, "vanilla-fp32", 3, tree="DT-000")
              + edited(f"{Q4B}_mistill-fp32_s0") + [n for s in range(3) for n in edited(f"{Q4B}_vanilla-fp32_s{s}")]),
    "R-D36": trained(SMOL, "mistill", 3),
    # App. M.2: both families' matched selections on DT-000's inputs, three seeds of each pick
    "R-D31": (["M2/select_lambda_mistill", "M2/select_lambda_randheads"] + trained(Q4B, "m2-mistill", 3, tree="M2")
              + trained(Q4B, "m2-randheads", 3, tree="M2")),
    "R-D32": (["M2/select_lambda_mistill", "M2/select_lambda_randheads"]
              + trained(Q4B, "m2-mistill", 3, tree="M2", own_heads=False)
              + trained(Q4B, "m2-randheads", 3, tree="M2", own_heads=False)),
    # App. O: the teacher's traces and ranking, the student's ranking, each family's selection, three
    # seeds of each arm read on their own heads, and the untrained student's own heads
    "R-D37": (["MQ/prepare_traced", "MQ/generate", "MQ/teacher_attribute", "MQ/targets", "MQ/student_attribute",
               "MQ/prepare", "MQ/select_lambda_mistill", "MQ/select_lambda_randheads", "MQ/own_heads_untrained"]
              + [n for arm in ("vanilla-bf16", "mistill", "randheads")
                 for n in trained("", arm, 3, tree="MQ", evaluated=False)]),
}

LAMBDA_SOURCE: dict[str, str | None] = {"mistill": BF16_SELECTION, "mistill-fp32": FP32_SELECTION,
                                        "mistill-fp32-bf16-lambda": BF16_SELECTION, "low-lambda": None,
                                        "randheads": BF16_SELECTION, "write-term": BF16_SELECTION,
                                        "m2-mistill": "M2/select_lambda_mistill",
                                        "m2-randheads": "M2/select_lambda_randheads"}
"""The selection whose pick each arm trains at (None: the arm file's own λ; App. I.3, I.4, M.1)."""

ENTRIES = {e.id: e for e in load()}
PRODUCED = [rid for rid, e in ENTRIES.items() if e.status == "produced"]


def test_every_produced_result_states_the_runs_it_needs():
    assert not [rid for rid in PRODUCED if rid not in APP_Q_RUNS], \
        "a result marked produced needs its Appendix Q runs listed in APP_Q_RUNS"


@pytest.mark.parametrize("rid", PRODUCED)
def test_a_produced_result_is_in_the_plan_with_every_run_the_paper_names(rid):
    """Every listed step exists in the plan, and the result's selection holds each one that trains
    or that runs an entry point the result reads (an evaluation where the result reads
    ``evaluate``, an own-heads readout where it reads ``own_heads``)."""
    plan = {s.name: s for s in paper_plan()}
    entry = ENTRIES[rid]
    listed = APP_Q_RUNS.get(rid, [])
    assert not [n for n in listed if n not in plan], f"{rid}: steps the plan does not hold"
    needed = [n for n in listed if plan[n].entry_point == "train" or set(plan[n].covers) & set(entry.entry_points)]
    chosen = {s.name for s in select(list(plan.values()), [rid])}
    missing = [name for name in needed if name not in chosen]
    assert not missing, f"{rid} is marked produced but reproduce would not run {missing}"


def test_the_table9_pair_reads_one_events_run_of_the_first_50_notes():
    plan = {s.name: s for s in paper_plan()}
    assert plan["HD-001/events_50"].params["max_notes"] == "50"
    pair = [plan[f"HD-001/attribute_50_{name}"] for name in ("intact", "detached")]
    assert [(s.inputs["events_run"], s.params["detach"]) for s in pair] == \
        [("HD-001/events_50", "false"), ("HD-001/events_50", "true")]


def test_the_self_test_and_the_probe_run_as_the_paper_ran_them():
    """R-C2: ten P1 events of one note (Sec. 2.3); R-D22: L35H26 moved to rank 8 of the fp32 arm's
    own P2C ranking, on the teacher's traces (App. I)."""
    plan = {s.name: s for s in paper_plan()}
    params = plan["HD-001/characterize"].params
    assert (params["selftest_events"], params["selftest_notes"]) == ("10", "1")
    probe = plan["DT-001/own_heads_probe_qwen3-4b_mistill-fp32_s0"]
    assert probe.entry_point == "own_heads" and probe.inputs["train_run"] == "DT-001/train_qwen3-4b_mistill-fp32_s0"
    assert {k: probe.params[k] for k in ("probe_head", "probe_phase", "probe_rank", "own_traces")} == \
        {"probe_head": "L35H26", "probe_phase": "P2C", "probe_rank": "8", "own_traces": "false"}


def test_each_mechanism_arm_trains_at_the_lambda_the_paper_names():
    plan = {s.name: s for s in paper_plan()}
    for step in plan.values():
        arm = step.params.get("arm") if step.entry_point == "train" else None
        if arm not in LAMBDA_SOURCE:
            continue
        selections = [n for n in step.needs if n.split("/", 1)[1].startswith("select_lambda")]
        if step.tree == "PP":  # App. P's pilot: λ fixed at 0.01, no selection
            assert not selections and step.params["overrides"] == "lambda_p1=0.01,lambda_p2=0.01", step.name
            continue
        expected = f"MQ/select_lambda_{arm}" if step.tree == "MQ" else LAMBDA_SOURCE[arm]  # App. O's own
        assert selections == ([expected] if expected else []), step.name


def test_the_selection_and_its_vanilla_reference_train_on_the_same_100_notes():
    """App. I.3: the grid at 100 training notes, and Tables 39-41's Vanilla CoT-KD reference
    trained on the same 100 (the lock's count and note seed, passed to train)."""

    plan = {s.name: s for s in paper_plan()}
    lock = load_lock(plan[BF16_SELECTION].params["lock"])
    refs = [plan[f"DT-001/train_qwen3-4b_vanilla-bf16_n100_s{seed}"] for seed in range(3)]
    assert {(r.params["train_notes"], r.params["train_notes_seed"]) for r in refs} == \
        {(str(lock.training.train_notes), str(lock.training.train_notes_seed))} == {("100", "0")}
    assert [plan[f"DT-001/evaluate_qwen3-4b_vanilla-bf16_n100_s{seed}"].params["split"] for seed in range(3)] \
        == ["val"] * 3


def test_the_paper_sizes_of_the_plan():
    """The note counts the appendix states: 100 HD-001 notes, 493 training, 100 validation and
    150 test notes in DT-000, and the λ grid at 100 training notes (App. I.3)."""
    counts = PaperCounts()
    assert (counts.characterization_traces, counts.train_notes, counts.val_notes, counts.test_notes,
            counts.selection_notes) == (100, 493, 100, 150, 100)
    plan = {s.name: s for s in paper_plan()}
    assert plan["HD-001/characterize"].work.units == 100
    assert plan["DT-000/evaluate_teacher"].work.units == 150
