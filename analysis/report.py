"""Assemble the report: find the input runs, build every table and figure they allow, and say
which ones were skipped and why. What a report is lives in :mod:`analysis.report_model`, the
builders of its sections in :mod:`analysis.report_sections`; this module finds the runs and calls
the builders in order.

:func:`collect_inputs` queries the tracking store (FINISHED runs only, the newest of each model,
arm, precision and seed); :func:`build_report` turns them into a :class:`Report` of tables
(numeric and display frames), plotly figures and notes. Nothing here writes to MLflow: the
``report`` stage (:mod:`mistill.stages.report`) logs the result.

A kind of run that is absent (no ``evaluate``, ``own_heads``, ``knockin`` or ``select_lambda``
runs, no reference arm, a missing artifact) skips Tables 1/10, 2, 43 and 3/45 with a note in the
report; it never stops the report. Tables 11, 15, 39-42, 47-51 and 52 and App. M.3's carriers are
always listed: where the runs read hold no data for them, their rows are empty and say why
(:attr:`ReportTable.reason` and the ``note`` column).

The report also names every deviation from the paper it finds in the runs it reads
(:mod:`analysis.run_deviations`): registry parameters at a value other than the default or the
paper's, and the runs' own ``mistill.deviation`` tags.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd
from mlflow.tracking import MlflowClient

from analysis import flip_tables, query, run_deviations, tables, transfer_tables
from analysis.characterization_compare import compared_runs, reading_runs
from analysis.report_model import LAMBDA_CELLS, Report, ReportInputs, ReportTable, TableChoices, cell_train_runs
from analysis.report_sections import (READ_SIDE_STAGES, ExtraRuns, ablations_section, audit_section,
                                      audit_shares_section, characterization_section, flip_test_section,
                                      global_sets_section, lambda_section, locus_section, matched_selection_section,
                                      own_heads_aligned_section, own_heads_probe_section, own_heads_section,
                                      read_side_section, selection_section, student_edits_section, task_section)
from analysis.report_sections import (characterization_compare_section, instruction_control_section,
                                      pilot_section, public_task_section,
                                      transfer_screen_section)
from analysis.report_sections import replicate_section, training_section
from mistill import stats
from mistill.tracking.naming import TAG_INPUT_PREFIX, TAG_STAGE

__all__ = ["MIN_TEST_NOTES", "MIN_TRAIN_STEPS", "STAGES", "EvidenceSize", "Report", "ReportInputs",
           "ReportTable", "build_report", "collect_inputs", "evidence_size"]

STAGES: tuple[str, ...] = ("knockin", "evaluate", "own_heads", "select_lambda")
"""The kinds of run the report reads (``mistill.stage`` tag) for Tables 1/10, 2, 43 and 3/45,
the newest of each cell; it also reads the ``attribute`` runs the knockin runs name, every
``train`` run, and every ``evaluate`` and ``own_heads`` run of any split
(:attr:`ReportInputs.extra`)."""

MIN_TEST_NOTES = 30
"""Fewer test notes than this behind the task table (Tables 2/43) make the report add
"Reading these numbers at this size": task micro-F1, validity and fidelity on so few notes say
little about an arm, while the per-event readouts (teacher-forced M1, knock-in recovery against
random sets, own-heads readouts) still rest on many events per note. A reading aid only: no
table's numbers depend on it; 30 is a conventional floor for a mean over notes."""

MIN_TRAIN_STEPS = 100
"""A trained arm whose train run ran fewer optimiser steps (``train/steps``) than this
makes the report add "Reading these numbers at this size": such an arm is barely moved from the
untrained student, so its task and fidelity numbers are not evidence about its objective. A
reading aid only, like :data:`MIN_TEST_NOTES`."""

_KEYS: dict[str, tuple[str, ...]] = {"knockin": ("model",), "evaluate": query.RUN_KEY,
                                     "own_heads": query.RUN_KEY,
                                     "select_lambda": (*query.RUN_KEY, "params.lock")}
_ARMED = ("evaluate", "own_heads")  # stages whose runs the ``arms`` filter applies to


def collect_inputs(client: MlflowClient, experiment: str, *, arms: Sequence[str] = (),
                   reference_arm: str = "", split: str = "test", own_heads_split: str = "",
                   compare_attribute_runs: Sequence[str] = (),
                   compare_labels: Sequence[str] = ()) -> ReportInputs:
    """The newest FINISHED run of each (model, arm, precision, seed) of every stage in
    :data:`STAGES` (``knockin``: the newest per model). ``arms`` (non-empty) restricts the
    ``evaluate`` and ``own_heads`` runs to those arms plus the reference, the teacher and the
    untrained student; of those, only runs on ``split`` are read (the λ selection's
    validation evaluations are not test results; runs without a split tag are kept; the
    ``own_heads`` runs on ``own_heads_split`` where given), and not
    those of a selection cell's or a partial training run (:func:`partial_train_runs`).
    ``compare_attribute_runs`` (pairs of attribute run ids) and ``compare_labels``: the two
    characterizations put side by side, and their knock-in runs (``attribute_compared``,
    ``knockin_compared`` of :attr:`ReportInputs.extra`; :func:`compared_runs`)."""
    keep = tuple(dict.fromkeys([*arms, reference_arm, tables.TEACHER_ARM,
                                tables.UNTRAINED_ARM])) if arms else ()
    # a selection is its lock's: App. M.2's matched selection of Mistill stands beside App. I.3's
    runs = {"select_lambda": query.latest_runs(query.stage_runs(client, experiment, "select_lambda",
                                                                params=("lock",)),
                                               _KEYS["select_lambda"])}
    train_all = query.stage_runs(client, experiment, "train", params=("train_notes",))
    cell_train = set(cell_train_runs(_selection_cells(runs["select_lambda"]), train_all))
    cell_train |= partial_train_runs(train_all)
    for stage in STAGES:
        if stage in runs:
            continue
        df = query.stage_runs(client, experiment, stage, arms=keep if stage in _ARMED else (),
                              params=_READ_PARAMS.get(stage, ()))
        if stage in _KEPT:
            df = _KEPT[stage](df)
        if stage in _ARMED and not df.empty:
            read = own_heads_split if stage == "own_heads" and own_heads_split else split
            df = df[(df["split"].isna() | (df["split"] == read))
                    & ~df["train_run"].isin(cell_train)]
        runs[stage] = query.latest_runs(df, _KEYS[stage])
    runs = {stage: runs[stage] for stage in STAGES}
    own_all = query.stage_runs(client, experiment, "own_heads", params=PROBE_PARAMS)
    extra = {"evaluate_all": query.stage_runs(client, experiment, "evaluate"),
             "own_heads_all": without_probes(own_all),
             "own_heads_probe": probes_only(own_all),
             "train": train_all,
             "select_lambda_all": query.stage_runs(client, experiment, "select_lambda")}
    named = set(runs["knockin"]["attribute_run"].dropna()) if not runs["knockin"].empty else set()
    attribute = query.stage_runs(client, experiment, "attribute")
    extra["attribute"] = attribute[attribute["run_id"].isin(named)].reset_index(drop=True) \
        if not attribute.empty else attribute
    for stage in ("locus", *READ_SIDE_STAGES):
        found = query.stage_runs(client, experiment, stage, params=_READ_PARAMS.get(stage, ()))
        if stage == "read_side":  # a frozen ranking read on other inputs is Table 59's, not Tables 16-19's
            extra["read_side_sets"] = other_sets_only(found)
            found = own_sets_only(found)
        extra[stage] = query.latest_runs(found, ("model",)) if not found.empty else found
        if stage == "trace_edit":  # Table 22 pairs the students' runs by arm and seed
            extra["trace_edit_all"] = query.latest_runs(found, query.RUN_KEY) if not found.empty else found
    extra["attribute_compared"], extra["knockin_compared"] = compared_runs(
        client, experiment, compare_attribute_runs, compare_labels)
    extra["audit_frame"] = query.stage_runs(client, experiment, "audit_frame")
    extra["flip_test"] = query.stage_runs(client, experiment, "flip_test", params=flip_tables.FLIP_PARAMS)
    extra["knockin_sets"] = other_sets_only(query.stage_runs(client, experiment, "knockin", params=SETS_PARAMS))
    extra["screen_generations"] = screen_generations(client, extra["knockin_sets"])
    prepared = query.stage_runs(client, experiment, "prepare", params=("task",))
    tasks = [str(t) for t in prepared["params.task"].dropna()] if not prepared.empty else []
    # App. P's pilot prepares KodCode's training problems beside BigCodeBench's development tasks
    task = "kodcode" if "kodcode" in tasks else tasks[0] if tasks else "icd10"
    extra["locus_compared"] = reading_runs(client, extra["attribute_compared"], "locus")
    extra["read_side_compared"] = reading_runs(client, extra["attribute_compared"], "read_side")
    return ReportInputs(experiment, runs, extra, task)


PROBE_PARAMS: tuple[str, ...] = ("probe_head", "probe_phase", "probe_rank")
"""The ``own_heads`` params of the k = 8 probe (``OwnHeadsConfig.probe_head``): a run with a
probe head reads a modified ranking, so it stays out of the arm tables (Tables 3, 45, ...) and is
shown beside its arm's own-ranking run instead."""


SETS_PARAMS: tuple[str, ...] = ("sets_run",)
"""The ``knockin`` param naming another characterization's sets (``KnockinStageConfig.sets_run``):
such a run is the instruction control's reading (Table 4), not its model's Tables 1/10."""


def _set(runs: pd.DataFrame, param: str) -> pd.Series:
    return runs[f"params.{param}"].fillna("").astype(str) != ""


def without_probes(runs: pd.DataFrame) -> pd.DataFrame:
    """``own_heads`` runs (read with :data:`PROBE_PARAMS`) on the arm's own ranking."""
    return runs if runs.empty else runs[~_set(runs, "probe_head")].reset_index(drop=True)


def probes_only(runs: pd.DataFrame) -> pd.DataFrame:
    """The probe runs among ``own_heads`` runs (read with :data:`PROBE_PARAMS`)."""
    return runs if runs.empty else runs[_set(runs, "probe_head")].reset_index(drop=True)


def own_sets_only(runs: pd.DataFrame) -> pd.DataFrame:
    """``knockin`` or ``read_side`` runs (read with :data:`SETS_PARAMS`) of their attribute run's own
    sets."""
    return runs if runs.empty else runs[~_set(runs, "sets_run")].reset_index(drop=True)


def _input(client: MlflowClient, run_id: str, name: str) -> str | None:
    """The run ``run_id`` read as its input ``name`` (its lineage tag), if any."""
    return client.get_run(run_id).data.tags.get(TAG_INPUT_PREFIX + name)


def screen_generations(client: MlflowClient, knockin_sets: pd.DataFrame) -> pd.DataFrame:
    """Per knock-in of a frozen ranking, the ``generate`` run whose traces its inputs carry (its
    attribute run's events run read it as the prepared corpus), where that is a generate run:
    columns ``knockin_run, run_id`` (Table 59's native row reads its ``generations``)."""
    rows = []
    for _, run in knockin_sets.iterrows():
        events = _input(client, run["attribute_run"], "events") if run.get("attribute_run") else None
        source = _input(client, events, "prepare") if events else None
        if source and client.get_run(source).data.tags.get(TAG_STAGE) == "generate":
            rows.append({"knockin_run": run["run_id"], "run_id": source})
    return pd.DataFrame(rows, columns=["knockin_run", "run_id"])


def other_sets_only(runs: pd.DataFrame) -> pd.DataFrame:
    """``knockin`` or ``read_side`` runs (read with :data:`SETS_PARAMS`) of another attribute run's
    sets."""
    return runs if runs.empty else runs[_set(runs, "sets_run")].reset_index(drop=True)


_READ_PARAMS: dict[str, tuple[str, ...]] = {"own_heads": (*PROBE_PARAMS, "prepare_run"), "knockin": SETS_PARAMS,
                                            "read_side": SETS_PARAMS, "evaluate": ("prepare_run",)}
_KEPT = {"own_heads": without_probes, "knockin": own_sets_only}
"""Per stage, the params read with its runs and the runs kept for the arm and characterization
tables (``prepare_run``: the corpus whose groups cluster App. O's readings)."""


def partial_train_runs(train: pd.DataFrame) -> set[str]:
    """The train runs on part of the training notes (their ``params.train_notes`` column above 0:
    the learning curve's smaller sizes, a selection's reference): their evaluations are left out of
    the tables of the arms (Tables 2, 3, 43, 45), which read the arms trained on every note; Table
    53 reads them."""
    if train.empty:
        return set()
    asked = pd.to_numeric(train["params.train_notes"], errors="coerce")
    return set(train.loc[asked > 0, "run_id"].astype(str))


def _selection_cells(selections: pd.DataFrame) -> pd.DataFrame:
    """Every selection's cell table, stacked (empty when none was read)."""
    if selections.empty:
        return pd.DataFrame()
    return query.per_note_table(selections, LAMBDA_CELLS, ["train_run"], ("run_id",)).frame


def build_report(inputs: ReportInputs, *, reference_arm: str,
                 n_resamples: int = stats.N_BOOTSTRAP,
                 corpus_resamples: int = stats.N_BOOTSTRAP_CORPUS, seed: int = 0,
                 choices: TableChoices = TableChoices(), split: str = "test",
                 client: MlflowClient | None = None, audit_labels: pd.DataFrame | None = None,
                 replicate_pairs: Sequence[tuple[str, str]] = ()) -> Report:
    """Every table and figure the inputs allow; the rest named in :attr:`Report.notes`."""
    client = client or MlflowClient()
    rep = Report(inputs.experiment, reference_arm,
                 counts={s: len(df) for s, df in inputs.runs.items()})
    global_sets_section(rep, inputs.runs["knockin"])
    task_notes = task_section(rep, inputs.runs["evaluate"], n_resamples, corpus_resamples, seed)
    own_heads_section(rep, inputs.runs["own_heads"], inputs.runs["evaluate"], task_notes,
               n_resamples, seed)
    own_heads_probe_section(rep, inputs.extra.get("own_heads_probe", pd.DataFrame()),
                            inputs.extra.get("own_heads_all", pd.DataFrame()), n_resamples, seed)
    own_heads_aligned_section(rep, inputs.runs["own_heads"], n_resamples, seed)
    cells = lambda_section(rep, inputs.runs["select_lambda"])
    extra = ExtraRuns.load(inputs, split)
    rep.counts.update({s: len(inputs.extra[s]) for s in ("attribute", "train")
                       if s in inputs.extra})
    characterization_section(rep, client, extra, choices, n_resamples, seed)
    locus_section(rep, inputs.extra.get("locus", pd.DataFrame()))
    read_side_section(rep, {stage: inputs.extra.get(stage, pd.DataFrame()) for stage in READ_SIDE_STAGES})
    audit_shares_section(rep, inputs.extra.get("audit_frame", pd.DataFrame()), audit_labels)
    audit_section(rep, inputs.runs["evaluate"], inputs.runs["own_heads"], audit_labels)
    student_edits_section(rep, inputs.extra.get("trace_edit_all", pd.DataFrame()), reference_arm, n_resamples, seed)
    selection_section(rep, inputs.runs["select_lambda"], cells, extra, n_resamples, seed)
    matched_selection_section(rep, inputs.extra.get("select_lambda_all", pd.DataFrame()), extra, n_resamples,
                              corpus_resamples, seed)
    ablations_section(rep, client, extra, cells, choices, n_resamples, seed)
    characterization_compare_section(
        rep, inputs.extra.get("attribute_compared", pd.DataFrame()),
        inputs.extra.get("knockin_compared", pd.DataFrame()),
        pd.concat([inputs.runs["knockin"], inputs.extra.get("knockin_compared", pd.DataFrame())],
                  ignore_index=True),
        inputs.extra.get("locus_compared", pd.DataFrame()), inputs.extra.get("read_side_compared", pd.DataFrame()))
    if inputs.task in transfer_tables.TRANSFER_TASKS:  # App. P's screen, not App. B's control
        transfer_screen_section(rep, inputs.extra.get("knockin_sets", pd.DataFrame()), n_resamples, seed,
                                read_side_sets=inputs.extra.get("read_side_sets", pd.DataFrame()),
                                generations=inputs.extra.get("screen_generations", pd.DataFrame()))
    elif inputs.task == "musique":  # App. O's readings, not App. B's control
        public_task_section(rep, inputs.runs["own_heads"], inputs.runs["evaluate"], n_resamples, seed,
                            flip_runs=inputs.extra.get("flip_test", pd.DataFrame()))
    elif inputs.task == "kodcode":  # App. P's programming pilot
        pilot_section(rep, inputs.runs["own_heads"], inputs.runs["evaluate"], n_resamples, seed)
    else:
        instruction_control_section(rep, client, inputs.extra.get("knockin_sets", pd.DataFrame()))
    training_section(rep, client, extra, cells, n_resamples, seed)
    flip_test_section(rep, inputs.extra.get("flip_test", pd.DataFrame()), n_resamples, seed)
    replicate_section(rep, extra, replicate_pairs, n_resamples, seed)
    rep.size_section = evidence_size(inputs.runs["evaluate"], task_notes,
                                     inputs.extra.get("train", pd.DataFrame())).section()
    rep.deviations, rep.deviation_problems = run_deviations.run_deviations(inputs.all_runs())
    rep.deviation_tags = run_deviations.deviation_tags(inputs.all_runs())
    rep.notes = list(dict.fromkeys(rep.notes))
    return rep


# ------------------------------------------------------------------ how much evidence there is
def _span(values: Sequence[int], unit: str) -> str:
    """``"2 optimiser steps"``, ``"2 to 120 optimiser steps"`` (values: distinct, sorted)."""
    if not values:
        return f"an unknown number of {unit}"
    n = f"{values[0]}" if len(values) == 1 else f"{values[0]} to {values[-1]}"
    return f"{n} {unit[:-1] if values[-1] == 1 else unit}"


@dataclass(frozen=True)
class EvidenceSize:
    """How much the task numbers rest on: the test notes behind the task table, and the
    optimiser steps and training notes of the trained arms' train runs.

    test_notes: distinct test notes scored (None: no evaluate run read).
    train_steps, train_notes: the distinct ``train/steps`` and ``n_notes`` of the train runs,
        sorted (empty: no train run read, or none logged them).
    """

    test_notes: int | None = None
    train_steps: tuple[int, ...] = ()
    train_notes: tuple[int, ...] = ()

    @property
    def small(self) -> bool:
        """Fewer than :data:`MIN_TEST_NOTES` test notes, or a train run of fewer than
        :data:`MIN_TRAIN_STEPS` optimiser steps."""
        return ((self.test_notes is not None and self.test_notes < MIN_TEST_NOTES)
                or bool(self.train_steps and self.train_steps[0] < MIN_TRAIN_STEPS))

    def task_basis(self) -> str:
        """What the task numbers rest on, in words, e.g. ``"arms trained for 2 optimiser steps
        on 8 notes, scored on 8 test notes"``."""
        parts = []
        if self.train_steps or self.train_notes:
            parts.append(f"arms trained for {_span(self.train_steps, 'optimiser steps')} on "
                         f"{_span(self.train_notes, 'notes')}")
        if self.test_notes is not None:
            parts.append(f"scored on {_span((self.test_notes,), 'test notes')}")
        return ", ".join(parts) or "an unknown number of notes and steps"

    def section(self) -> list[str]:
        """The report's "Reading these numbers at this size" section (Markdown lines), or no
        lines when the evidence is not small."""
        if not self.small:
            return []
        return [
            "## Reading these numbers at this size", "",
            f"These runs are small: {self.task_basis()}. The report calls runs small below "
            f"{MIN_TEST_NOTES} test notes or {MIN_TRAIN_STEPS} optimiser steps "
            "(`analysis.report.MIN_TEST_NOTES`, `MIN_TRAIN_STEPS`).", "",
            "- **Meaningful at this size:** teacher-forced M1 (P(margin > 0) per event kind), "
            "knock-in recovery of the global sets against count-matched random sets (Tables "
            "1/10), and the own-heads readouts (Tables 3/45: own top-k recovery against random "
            "heads, region lift, near-miss share). Each is measured per event, many events per "
            "note, and the recoveries against a control on the same notes.",
            f"- **Not meaningful at this size:** task micro-F1, validity and fidelity of the "
            f"trained arms (Tables 2 and 43, and the task columns of the other tables): "
            f"{self.task_basis()}. Differences between arms there are not evidence about "
            f"their objectives.", ""]


def _ints(frame: pd.DataFrame, column: str) -> tuple[int, ...]:
    if frame.empty or column not in frame.columns:
        return ()
    values = pd.to_numeric(frame[column], errors="coerce").dropna()
    return tuple(sorted({int(v) for v in values}))


def evidence_size(evaluate: pd.DataFrame, task_notes: pd.DataFrame | None,
                  train: pd.DataFrame) -> EvidenceSize:
    """The size of the evidence behind the task table.

    evaluate: the evaluate runs of the task table (their ``n_notes`` metric is the fallback
    count of test notes); task_notes: their per-note table (distinct ``note_id`` counted when
    present); train: train runs (``train/steps``, ``n_notes`` metrics), restricted to those the
    evaluate runs name (``train_run``) when any are named.
    """
    if task_notes is not None and not task_notes.empty and "note_id" in task_notes.columns:
        test_notes: int | None = int(task_notes["note_id"].nunique())
    else:
        counts = _ints(evaluate, "n_notes")
        test_notes = counts[-1] if counts else None
    named = set(evaluate["train_run"].dropna()) if "train_run" in evaluate.columns else set()
    if not train.empty and named and train["run_id"].isin(named).any():
        train = train[train["run_id"].isin(named)]
    return EvidenceSize(test_notes, _ints(train, "train/steps"), _ints(train, "n_notes"))
