"""The report's table builders, one function per section of tables: each reads the runs it needs,
adds its tables, figures and notes to a :class:`analysis.report_model.Report`, and says what it
skipped and why. :func:`analysis.report.build_report` calls them in the report's order."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from analysis import (ablation_tables, characterization, figures, locus_figures, query, run_deviations,
                      selection_tables as seltab, tables)
from analysis import aligned_events as aligned
from analysis import characterization_compare as compare
from analysis import flip_tables
from analysis import matched_tables as matched
from analysis import pilot_tables, public_task_tables
from analysis import training_tables
from analysis import transfer_tables
from analysis.audit import stratified_readouts
from analysis.edit_tables import TABLE_COLUMNS, edit_pairs_table
from analysis.report_model import (DECISION, LAMBDA_CELLS, OWN_HEADS_PER_NOTE, PER_NOTE_METRICS, PER_NOTE_SETS,
                                   Report, ReportInputs, ReportTable, TableChoices, cell_train_runs)
from mistill import stats
from mistill.errors import MistillInputError
from mistill.evaluation import audit_frame
from mistill.io import read_json
from mistill.stages.common import RunReader
from mistill.stages.readside import NOTE_LIFTS, READBACK_NOTES


# ---------------------------------------------------------------------------------- sections
def _load(rep: Report, runs: pd.DataFrame, artifact: str, required: Sequence[str],
          run_columns: Sequence[str] = ("run_id", *query.RUN_KEY)) -> pd.DataFrame:
    loaded = query.per_note_table(runs, artifact, required, run_columns)
    for run_id, why in loaded.missing.items():
        rep.notes.append(f"run {run_id}: {why}")
    return loaded.frame


def _skip(rep: Report, what: str, why: str) -> None:
    rep.notes.append(f"{what} skipped: {why}.")


def global_sets_section(rep: Report, runs: pd.DataFrame) -> None:
    what = "Tables 1/10 (global head sets) and the recovery-against-k figure"
    if runs.empty:
        return _skip(rep, what, "no FINISHED knockin runs")
    rows = _load(rep, runs, PER_NOTE_SETS,
                 ["note_id", "phase", "k", "set", "necessity", "recovery"], ("run_id", "model"))
    if rows.empty:
        return _skip(rep, what, f"no knockin run has {PER_NOTE_SETS}")
    table = tables.global_sets_table(rows)
    ks = sorted(int(k) for k in table["k"].unique())
    rep.tables.append(ReportTable(
        "table10_global_sets", "Table 10: global per-phase sets at every k",
        "Necessity (share of the clean margin destroyed by mean-ablation; >1: flipped) and "
        "knock-in recovery in another note's context, medians over notes, against "
        "count-matched random and bottom-k sets; notes: where the global set beats random / "
        "notes compared.", table, tables.global_sets_display(table)))
    table1_ks = [k for k in ks if k != 16] or ks
    rep.tables.append(ReportTable(
        "table1_global_sets", "Table 1: global per-phase sets",
        f"Table 10 at k in {table1_ks} (k=16 only in Table 10).",
        table[table["k"].isin(table1_ks)].reset_index(drop=True),
        tables.global_sets_display(table, table1_ks)))
    _figure(rep, "recovery_vs_k_global", figures.recovery_long_from_sets(rows),
            "Knock-in recovery of the global sets",
            "median over notes against k; dashed: count-matched random and bottom-k floors")


def _figure(rep: Report, name: str, long: pd.DataFrame, title: str, subtitle: str) -> None:
    """A recovery figure, or a note saying why there is none (no finite recovery to plot)."""
    if long.dropna(subset=["recovery"]).empty:
        _skip(rep, f"figure {name}", "no finite recovery values (no event passed the range gate)")
        return
    rep.figures[name] = figures.recovery_figure(long, title, subtitle)


def task_section(rep: Report, runs: pd.DataFrame, n_resamples: int, corpus_resamples: int,
          seed: int) -> pd.DataFrame | None:
    """Tables 2 and 43; returns the per-note task table (for Table 45's task lines)."""
    if runs.empty:
        _skip(rep, "Table 2 (task and fidelity) and Table 43 (paired differences)",
              "no FINISHED evaluate runs")
        return None
    t2 = tables.task_table(runs, rep.reference_arm)
    rep.tables.append(ReportTable(
        "table2_task_fidelity", "Table 2: task and fidelity per arm",
        "Corpus-level metrics of each evaluate run, mean ± sd over seeds (single-seed rows "
        "marked [1 seed]); gap recovered: (arm - untrained) / (teacher - untrained) on "
        "micro-F1.", t2, tables.task_display(t2)))
    per_note = _load(rep, runs, PER_NOTE_METRICS, ["note_id", "micro_f1"])
    what = "Table 43 (paired differences against the reference)"
    if per_note.empty:
        _skip(rep, what, f"no evaluate run has {PER_NOTE_METRICS}")
        return None
    if not (per_note["arm"] == rep.reference_arm).any():
        _skip(rep, what, f"no evaluate run of the reference arm {rep.reference_arm!r}")
        return per_note
    try:
        t43, diffs = tables.task_paired_table(per_note, rep.reference_arm,
                                              n_resamples=n_resamples,
                                              corpus_resamples=corpus_resamples, seed=seed)
    except MistillInputError as exc:
        _skip(rep, what, str(exc))
        return per_note
    if t43.empty:
        _skip(rep, what, "no arm shares a model with the reference arm")
        return per_note
    rep.tables.append(ReportTable(
        "table43_paired", "Table 43: paired differences behind Table 2",
        f"Arm minus {rep.reference_arm} on the same notes, seed-averaged per note: mean "
        f"difference with a percentile bootstrap 95% interval ({n_resamples} resamples), "
        "two-sided Wilcoxon signed-rank p (zeros dropped), exact sign-test p, notes "
        "higher/lower/tied; for micro-F1 also the corpus-level difference with notes "
        f"resampled ({corpus_resamples}) and its bootstrap p.", t43, tables.paired_display(t43)))
    rep.figures["paired_differences_task"] = figures.paired_differences_figure(
        diffs, t43, f"Per-note differences against {rep.reference_arm}",
        "seed-averaged per note; red: mean with its bootstrap 95% interval")
    return per_note


def own_heads_section(rep: Report, runs: pd.DataFrame, eval_runs: pd.DataFrame,
               task_notes: pd.DataFrame | None, n_resamples: int, seed: int) -> None:
    what = "Tables 3/45 (own-heads readouts) and the own-heads recovery figure"
    if runs.empty:
        return _skip(rep, what, "no FINISHED own_heads runs")
    per_note = ablation_tables._traces(_load(  # with λ, for the figure's legend (arm and λ)
        rep, runs, OWN_HEADS_PER_NOTE, ["note_id", "phase", "k", "recovery_own",
                                        "recovery_random"], ("run_id", *query.RUN_KEY, "lambda")), "teacher")
    if per_note.empty:
        return _skip(rep, what, f"no own_heads run has {OWN_HEADS_PER_NOTE}")
    seeds = tables.own_heads_seed_table(per_note, runs, eval_runs, rep.reference_arm)
    t3 = tables.own_heads_table(seeds, rep.reference_arm)
    rep.tables.append(ReportTable(
        "table3_own_heads", "Table 3: mechanism on each arm's own heads",
        "Knock-in recovery of the own top-k per phase (median over notes, then mean ± sd over "
        "seeds; random-k floor in parentheses; in brackets the gated events and notes a seed's cell "
        "rests on, 'n too small' in place of a value below the minimum of analysis.evidence), then "
        "the run readouts (M2 region lift, prefix share, M3 near-miss share) and the task micro-F1 "
        "of the same seeds.",
        t3, tables.own_heads_display(t3)))
    rep.tables.append(ReportTable(
        "table45_own_heads_seeds", "Table 45: own-heads readouts per seed",
        "Per seed: medians over notes, random-k floors in parentheses, the gated events and notes "
        "behind each cell in brackets ('n too small' below the minimum); task: that seed's "
        "micro-F1.", seeds, tables.own_heads_seed_display(seeds)))
    _figure(rep, "recovery_vs_k_own", figures.recovery_long_from_own(per_note), "Own-heads knock-in recovery",
            "mean over seeds of medians over notes, against k; dashed: random-k floors")
    cmp_what = "Table 45 seed-matched comparisons"
    if not (per_note["arm"] == rep.reference_arm).any():
        return _skip(rep, cmp_what, f"no own_heads run of the reference arm "
                                    f"{rep.reference_arm!r}")
    try:
        t45, diffs = tables.own_heads_paired_table(per_note, rep.reference_arm, task_notes,
                                                   n_resamples=n_resamples, seed=seed)
    except MistillInputError as exc:
        return _skip(rep, cmp_what, str(exc))
    if t45.empty:
        return _skip(rep, cmp_what, "no arm shares a model with the reference arm")
    rep.tables.append(ReportTable(
        "table45_seed_matched", "Table 45: seed-matched comparisons",
        f"Arm minus {rep.reference_arm}, seed i against seed i (a one-seed side pairs with "
        "every seed), note-clustered: per note the mean of its seed pairs' differences, then "
        "the tests over notes (bootstrap 95% interval of the mean, Wilcoxon, sign test); "
        "pooled note-pair counts are in the CSV, descriptive only.",
        t45, tables.paired_display(t45)))
    rep.figures["paired_differences_own_heads"] = figures.paired_differences_figure(
        diffs, t45, f"Seed-matched differences against {rep.reference_arm}",
        "per note, the mean over its seed pairs; red: mean with its bootstrap 95% interval")


def _selection_columns(run_id: str) -> dict[str, str]:
    """``{<lock's metric>: "metric", <lock's tie-break>: "tie_break"}`` from the run's
    ``decision.json`` (the ``select_lambda`` stage names those columns after its lock)."""
    try:
        rule = read_json(RunReader(run_id, field=DECISION).file(DECISION))["lock"]["selection"]
        return {str(rule["metric"]): "metric", str(rule["tie_break"]): "tie_break"}
    except (MistillInputError, OSError, KeyError, TypeError, ValueError):
        return {}


def _lambda_cells(rep: Report, runs: pd.DataFrame) -> pd.DataFrame:
    """Every run's cells with ``metric`` and ``tie_break`` columns (named so in ``cells.csv``,
    or after the lock's metric and tie-break as ``decision.json`` says) and ``picked``."""
    frames = []
    for i in range(len(runs)):
        cells = _load(rep, runs.iloc[[i]], LAMBDA_CELLS, ["lambda_p1", "lambda_p2", "state"])
        if cells.empty:
            continue
        if not {"metric", "tie_break"} <= set(cells.columns):
            cells = cells.rename(columns=_selection_columns(runs["run_id"].iloc[i]))
        if not {"metric", "tie_break"} <= set(cells.columns):
            rep.notes.append(f"run {runs['run_id'].iloc[i]}: {LAMBDA_CELLS} has no metric and "
                             f"tie-break columns, and {DECISION} does not name them")
            continue
        if "picked" not in cells.columns:
            cells["picked"] = False
        frames.append(cells)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def lambda_section(rep: Report, runs: pd.DataFrame) -> pd.DataFrame:
    """The λ cells table and frontier figure; returns every run's cells (empty without)."""
    what = "The λ validation frontier"
    if runs.empty:
        _skip(rep, what, "no FINISHED select_lambda runs")
        return pd.DataFrame()
    cells = _lambda_cells(rep, runs)
    if cells.empty:
        _skip(rep, what, f"no select_lambda run has a readable {LAMBDA_CELLS}")
        return cells
    names = dict(zip(runs["run_id"], runs["run_name"]))
    cells.insert(0, "selection", cells["run_id"].map(names).fillna(cells["run_id"]))
    cells["picked"] = cells["picked"].astype(str).str.lower().isin(["true", "1"])
    cols = ["selection", "model", "arm", "lambda_p1", "lambda_p2", "metric", "tie_break",
            "state", "picked"]
    shown = cells[cols].sort_values(["selection", "lambda_p1", "lambda_p2"]).reset_index(
        drop=True)
    rep.tables.append(ReportTable(
        "lambda_cells", "λ selection cells",
        "Validation metric and tie-break per grid cell, the pick marked.", shown, shown))
    rep.figures["lambda_frontier"] = figures.lambda_frontier_figure(cells)
    return cells


# ------------------------------------------------------------------ always-listed tables
def _listed(rep: Report, name: str, title: str, caption: str, numeric: pd.DataFrame,
            display: pd.DataFrame, reason: str = "", columns: Sequence[str] = ()) -> None:
    """Add a table that is listed whether or not it has rows: without rows its display is one
    row of empty cells whose ``note`` says why (``reason``)."""
    if numeric.empty and not reason:
        reason = "no rows"
    if numeric.empty:
        cols = list(display.columns) or list(columns)
        display = pd.DataFrame([{**{c: "" for c in cols if c != "note"}, "note": reason}])
        numeric = pd.DataFrame(columns=list(numeric.columns) or [*cols, "note"])
    rep.tables.append(ReportTable(name, title, caption, numeric, display,
                                  reason if numeric.empty else ""))


_PER_NOTE_RUN_COLUMNS = ("run_id", "split", *query.RUN_KEY)


@dataclass
class ExtraRuns:
    """The runs beyond the newest of each cell, with their per-note tables."""

    attribute: pd.DataFrame
    train: pd.DataFrame
    evaluate: pd.DataFrame
    own: pd.DataFrame
    eval_notes: pd.DataFrame
    own_notes: pd.DataFrame
    split: str

    @classmethod
    def load(cls, inputs: ReportInputs, split: str) -> ExtraRuns:
        empty = pd.DataFrame(columns=["run_id", "run_name", "start_time", *query.TAG_COLUMNS])
        get = inputs.extra.get
        evaluate, own = get("evaluate_all", empty), get("own_heads_all", empty)
        eval_notes = query.per_note_table(evaluate, PER_NOTE_METRICS, ["note_id", "micro_f1"],
                                          _PER_NOTE_RUN_COLUMNS).frame
        own_notes = query.per_note_table(own, OWN_HEADS_PER_NOTE,
                                         ["note_id", "phase", "k", "recovery_own",
                                          "recovery_random"], _PER_NOTE_RUN_COLUMNS).frame
        return cls(get("attribute", empty), get("train", empty), evaluate, own,
                   _norm(eval_notes), _norm(own_notes), split)

    def test_runs(self, frame: pd.DataFrame, cell_train: set[str]) -> pd.DataFrame:
        """The newest run of each cell on the report's split (runs without a split tag kept),
        leaving out the readouts of λ-selection cells (``cell_train``: their train runs)."""
        if frame.empty:
            return frame
        on = frame[(frame["split"].isna() | (frame["split"] == self.split))
                   & ~frame["train_run"].isin(cell_train)]
        return query.latest_runs(on)


def _norm(frame: pd.DataFrame) -> pd.DataFrame:
    if frame.empty:
        return frame
    out = frame.copy()
    for col in ("model", "arm", "precision", "split"):
        if col in out.columns:
            out[col] = out[col].fillna("").astype(str)
    return out


# ---------------------------------------------------------------------- Tables 25-33, Figure 1
LOCUS_TABLES: tuple[tuple[str, str, str], ...] = (
    ("table25_suffixes", "Table 25: the locus under the forcing suffixes",
     "Outcome shares, the median distance of the window loci and the per-mention agreement with the "
     "run's suffix, on the same chapter mentions."),
    ("table26_outcomes", "Table 26: where the chapter can be elicited",
     "The forcing probe's outcome for every chapter mention, as a share of each column's mentions; "
     "the previous code is the code mentioned just before, in the same or in another chapter."),
    ("locus_distances", "Locus distances and robustness",
     "The window loci's distance before the letter, the jump across the crossing step, the share "
     "whose curve returns above theta, and the per-note window and inherited shares."),
    ("table27_locus_tokens", "Table 27: the locus token",
     "Each token class's share among all attribution-window tokens (base rate), among the window "
     "loci, and the lift."),
    ("table28_importance_position", "Table 28: where the importance sits",
     "Mean share of each attributed mention's positive importance (window plus suffix) at the locus, "
     "1-3, 4-15 and 16-63 tokens before it, and at the suffix."),
    ("table29_prose_time", "Table 29: the prose-time ranking",
     "Decision-specific importance summed over the attribution-window positions (I_c, nats, mean "
     "over notes) with its 95% bootstrap interval, and the head's rank in the emission-time chapter "
     "ranking; shared_top<k>: heads shared with the emission set's top-k."),
    ("table30_pass_a", "Table 30: pass A",
     "Share of the forced chapter margin destroyed by mean-ablating each set at the locus (medians "
     "over notes of per-note means, 10th-90th percentile over notes); window/suffix: restricted by "
     "position."),
    ("table31_follow_through", "Table 31: follow-through of the window ablation to the code",
     "Per set mean-ablated over the attribution window (sustained: to the code), the natural margin "
     "removed at the chapter letter after the original continuation, the ratio natural/forced on "
     "mentions whose forced drop exceeds one nat, and the share of natural decisions flipped."),
    ("table32_pass_b", "Table 32: pass B, the fixed prose-time set",
     "Share of the forced chapter margin destroyed by the global prose-time top-k at the window, the "
     "suffix and both, against random-k and the prose-time bottom-k at the window; notes on which "
     "the prose-time set beats random."),
    ("table33_locus_reads", "Table 33: what the prose-time heads read at the locus",
     "Attention at the locus token in the natural context, mean over loci, for four 16-head groups: "
     "share on the emitted chapter's lines (region), other lines, the note, the reasoning prose and "
     "the sink; region lift; n_eff over inventory tokens."),
    ("residual_swap", "Residual swap (Figure 5's data)",
     "Per place (locus, tail, code token) and layer: medians over mentions of the forced and natural "
     "margins after writing a donor mention's residual in."))


def locus_section(rep: Report, runs: pd.DataFrame) -> None:
    """Tables 25-33 and Figure 1 from the newest ``locus`` run of each model."""
    if runs.empty:
        return _skip(rep, "Tables 25-33 and Figure 1 (the locus pass)", "no FINISHED locus runs")
    loaded: dict[str, pd.DataFrame] = {}
    for name, title, caption in LOCUS_TABLES:
        frame = _load(rep, runs, f"{name}.csv", [], ("run_id", "model"))
        loaded[name] = frame
        _listed(rep, name, title, caption, frame, frame.drop(columns=["run_id"], errors="ignore"),
                "" if not frame.empty else "the locus runs logged no rows for it")
    mentions = _load(rep, runs, "locus_mentions.csv", ["outcome", "distance"], ("run_id", "model"))
    for key, fig in locus_figures.figure1(mentions, loaded["table30_pass_a"], loaded["table32_pass_b"],
                                          loaded["table33_locus_reads"], loaded["table27_locus_tokens"]).items():
        rep.figures[key] = fig


# ------------------------------------------------------------------ App. I: the k = 8 probe
def _cell_by_note(per_note: pd.DataFrame, phase: str, k: int) -> dict[str, float]:
    cell = per_note[(per_note["phase"] == phase) & (per_note["k"] == k)]
    return {str(n): float(v) for n, v in zip(cell["note_id"], cell["recovery_own"])}


def own_heads_probe_section(rep: Report, probes: pd.DataFrame, own_all: pd.DataFrame, n_resamples: int,
                            seed: int) -> None:
    """App. I's k = 8 probe (R-D22): each probe run's cell (a named head moved into the arm's own
    ranking) beside the same arm's own-ranking cell, and against the reference arm's own-ranking
    cell of the same model, seed-matched and note-clustered."""
    name, title = "own_heads_probe", "App. I: the k = 8 probe, a named head placed in the own ranking"
    cols = ["run_id", "model", "arm", "precision", "seed", "probe_head", "phase", "k", "n_notes", "probe",
            "own_ranking", "own_ranking_run", "vs_own_ranking", "vs_own_ranking_low", "vs_own_ranking_high",
            "reference", "vs_reference", "vs_reference_low", "vs_reference_high", "notes_higher", "notes_lower"]
    caption = ("Knock-in recovery of the own top-k with the named head moved to rank k of the arm's own "
               "ranking and nothing else changed (probe), median over notes; beside it the same arm's "
               "own-ranking cell (the result; the probe is post hoc, a diagnosis), the note-paired difference "
               f"probe minus own ranking, and probe minus the reference arm ({rep.reference_arm}) on its own "
               "ranking, seed-matched and note-clustered (95% bootstrap intervals; notes higher / lower).")
    if probes.empty:
        return _listed(rep, name, title, caption, pd.DataFrame(), pd.DataFrame(),
                       "no FINISHED own_heads runs with a probe_head", columns=cols)
    probes = query.latest_runs(probes, (*query.RUN_KEY, "params.probe_head", "params.probe_phase",
                                        "params.probe_rank"))
    own = query.latest_runs(own_all, query.RUN_KEY) if not own_all.empty else own_all
    needed = ["note_id", "phase", "k", "recovery_own"]
    rows = []
    for _, run in probes.iterrows():
        phase, k = str(run["params.probe_phase"]), int(float(run["params.probe_rank"]))
        probe_notes = _cell_by_note(ablation_tables._traces(_load(rep, pd.DataFrame([run]), OWN_HEADS_PER_NOTE,
                                                                  needed, ("run_id",)), "teacher"), phase, k)
        rec: dict[str, Any] = {c: run.get(c) for c in ("run_id", *query.RUN_KEY)}
        rec.update({"probe_head": run["params.probe_head"], "phase": phase, "k": k, "n_notes": len(probe_notes),
                    "probe": _median_of(probe_notes)})
        same = own[(own["model"] == run["model"]) & (own["arm"] == run["arm"])
                   & (own["precision"].fillna("") == (run["precision"] or ""))
                   & (own["seed"] == run["seed"])] if not own.empty else own
        if len(same):
            base = _cell_by_note(ablation_tables._traces(_load(rep, same.iloc[:1], OWN_HEADS_PER_NOTE, needed,
                                                               ("run_id",)), "teacher"), phase, k)
            rec.update({"own_ranking": _median_of(base), "own_ranking_run": same.iloc[0]["run_id"]})
            if base:
                d = stats.note_clustered({0: stats.per_note_differences(probe_notes, base)},
                                         n_resamples=n_resamples, seed=seed).overall
                rec.update({"vs_own_ranking": d.mean_diff, "vs_own_ranking_low": d.ci_low,
                            "vs_own_ranking_high": d.ci_high})
        refs = own[(own["model"] == run["model"]) & (own["arm"] == rep.reference_arm)] if not own.empty else own
        ref_notes = {int(r["seed"]): _cell_by_note(ablation_tables._traces(_load(
            rep, pd.DataFrame([r]), OWN_HEADS_PER_NOTE, needed, ("run_id",)), "teacher"), phase, k)
            for _, r in refs.iterrows() if not pd.isna(r["seed"])}
        ref_notes = {s: v for s, v in ref_notes.items() if v}
        if ref_notes and probe_notes:
            pairs = stats.seed_matched_pairs({int(run["seed"]): probe_notes}, ref_notes)
            c = stats.note_clustered({p: stats.per_note_differences(a, b) for p, (a, b) in pairs.items()},
                                     n_resamples=n_resamples, seed=seed)
            rec.update({"reference": rep.reference_arm, "vs_reference": c.overall.mean_diff,
                        "vs_reference_low": c.overall.ci_low, "vs_reference_high": c.overall.ci_high,
                        "notes_higher": c.overall.n_higher, "notes_lower": c.overall.n_lower})
        rows.append(rec)
    table = pd.DataFrame.from_records(rows).reindex(columns=cols)
    shown = pd.DataFrame.from_records([{
        "model": r["model"], "arm": r["arm"], "seed": r["seed"], "probe": f"{r['probe_head']} at rank {r['k']} "
        f"({r['phase']})", "notes": r["n_notes"], "probe k": _fmt(r["probe"]), "own ranking": _fmt(r["own_ranking"]),
        "probe - own": tables.fmt_ci(r["vs_own_ranking"], r["vs_own_ranking_low"], r["vs_own_ranking_high"])
        if not pd.isna(r["vs_own_ranking"]) else "",
        f"probe - {rep.reference_arm}": tables.fmt_ci(r["vs_reference"], r["vs_reference_low"],
                                                       r["vs_reference_high"]) if not pd.isna(r["vs_reference"]) else "",
        "higher/lower": f"{int(r['notes_higher'])}/{int(r['notes_lower'])}" if not pd.isna(r["notes_higher"]) else ""}
        for _, r in table.iterrows()])
    _listed(rep, name, title, caption, table, shown, columns=cols)


def own_heads_aligned_section(rep: Report, runs: pd.DataFrame, n_resamples: int, seed: int) -> None:
    """Table 38's check (R-D19): each student family's own-heads P2C recovery gain over the
    reference arm on every event it realizes and on the events every student's tokenizer realizes."""
    name, title = "own_heads_aligned", "Table 38: own-heads gains on the events every tokenizer realizes"
    caption = (f"Per student model and arm: own-heads P2C knock-in recovery at k={ablation_tables.OWN_K} minus "
               f"{rep.reference_arm}'s, seed-matched and note-clustered (mean over notes of the per-note "
               "difference, 95% bootstrap interval; notes higher / lower), on every contrastive event the model "
               "realizes (all) and on those every student's tokenizer realizes (aligned; the teacher's event ids "
               "intersected over the students' own_heads runs).")
    cols = ["model", "arm", "reference", "n_events", "n_aligned", "all.gain", "aligned.gain"]
    if runs.empty:
        return _listed(rep, name, title, caption, pd.DataFrame(), pd.DataFrame(), "no FINISHED own_heads runs",
                       columns=cols)
    events = _load(rep, runs, "own_heads_knockin_events.csv", ["note_id", "event_id", "phase", "k", "recovery",
                                                               "gated"], ("run_id", *query.RUN_KEY))
    if len(events) and "traces" in events.columns:
        events = events[events["traces"] == "teacher"]
    models = set(events.loc[~events["arm"].isin(aligned.EXCLUDED_ARMS), "model"]) if len(events) else set()
    if len(models) < 2:
        return _listed(rep, name, title, caption, pd.DataFrame(), pd.DataFrame(),
                       "the own_heads runs read fewer than two student models (one tokenizer)", columns=cols)
    table = aligned.aligned_gain_table(events, rep.reference_arm, k=ablation_tables.OWN_K,
                                       n_resamples=n_resamples, seed=seed)
    shown = pd.DataFrame.from_records([{
        "model": r["model"], "arm": r["arm"], "events (aligned)": f"{int(r['n_events'])} ({int(r['n_aligned'])})",
        **{f"{label} - {r['reference']}": tables.fmt_ci(r[f"{part}.gain"], r[f"{part}.low"], r[f"{part}.high"])
           if not pd.isna(r[f"{part}.gain"]) else "" for part, label in (("all", "all"), ("aligned", "aligned"))},
        "higher/lower (aligned)": f"{int(r['aligned.higher'])}/{int(r['aligned.lower'])}"
        if not pd.isna(r["aligned.higher"]) else ""} for _, r in table.iterrows()])
    _listed(rep, name, title, caption, table, shown, "" if len(table) else "no arm beside the reference arm",
            columns=cols)


def _median_of(values: dict[str, float]) -> float:
    finite = [v for v in values.values() if pd.notna(v)]
    return float(pd.Series(finite).median()) if finite else float("nan")


def _fmt(v: Any) -> str:
    return "" if v is None or pd.isna(v) else f"{float(v):.3f}"


# ---------------------------------------------------------------------- Table 54
def flip_test_section(rep: Report, all_runs: pd.DataFrame, n_resamples: int, seed: int) -> None:
    """Table 54 (App. N.3, R-D33): every checkpoint's behavioural readings on the evidence-flip
    cohort, and the locked seed-pair contrasts in ``D``; Table 55 (App. N.4, R-D34): the key
    masks' effects and the training-benefit interaction (:mod:`analysis.flip_tables`). Each
    run's ``flip_cases`` table is read once for all four tables."""
    every = flip_tables.flip_runs(all_runs)
    runs = flip_tables.behaviour_runs(every)
    cases = pd.DataFrame()
    if not every.empty:
        cases = _load(rep, every, "flip_cases.csv", ["case_id", "D"], ("run_id",))
        cases["case_id"] = cases["case_id"].astype(str)
    name, title = "table54_flip_behaviour", "Table 54: the evidence-flip test, behavioural half"
    caption = ("Per checkpoint on the frozen cohort (four conditions, N answers each, sample k seeded alike in "
               "every condition): D = (mean v original - mean v flipped) / 2 with its case-clustered 95% interval, "
               "s (mean of the follow rates), the follow rates (A-only under the original, B-only under the flip), "
               "paired success (both at one sample index), each control's agreement with the original's v and its "
               "expected A-only rate, invalid outputs, D's decomposition into A lost and B adopted, and the "
               "category-level D on the cases whose categories differ.")
    table = flip_tables.flip_behaviour_table(runs) if not runs.empty else pd.DataFrame()
    shown = pd.DataFrame.from_records([{
        "model": r["model"], "arm": r["arm"], "precision": r["precision"] or "", "seed": r["seed"],
        "cases": r["n_cases"], "D": tables.fmt_ci(r["D"], r["D_lo"], r["D_hi"]), "s": _fmt(r["s"]),
        "follow A (orig.)": _fmt(r["follow_original"]), "follow B (flip)": _fmt(r["follow_flipped"]),
        "paired success": _fmt(r["paired_success"]),
        "agreement irr./order": f"{_fmt(r['agreement_irrelevant'])} / {_fmt(r['agreement_order'])}",
        "expected A irr./order": f"{_fmt(r['expected_irrelevant'])} / {_fmt(r['expected_order'])}",
        "invalid": _fmt(r["invalid"]), "D: A lost + B adopted": f"{_fmt(r['d_lose_a'])} + {_fmt(r['d_adopt_b'])}",
        "D category": tables.fmt_ci(r["D_category"], r["D_category_lo"], r["D_category_hi"])}
        for _, r in table.iterrows()])
    _listed(rep, name, title, caption, table, shown, "no FINISHED flip_test runs",
            columns=flip_tables.BEHAVIOUR_COLUMNS)
    name, title = "table54_flip_contrasts", "Table 54 (bottom): the locked seed-pair contrasts in D"
    caption = ("The locked primary (bf16 Mistill minus bf16 Vanilla CoT-KD) and secondary (the fp32 pair): per "
               "case the seed-matched differences in D averaged over the seed pairs; mean with a case-clustered "
               "95% bootstrap interval, median, cases higher / lower / tied with the exact sign test, and each seed "
               "pair's mean difference. App. N.1's pre-registered minimum effect is 0.10 in D.")
    contrasts = flip_tables.flip_contrasts_table(runs, cases, n_resamples=n_resamples, seed=seed) \
        if not runs.empty else pd.DataFrame()
    shown = pd.DataFrame.from_records([{
        "contrast": r["contrast"], "arm - reference": f"{r['arm']} - {r['reference']}", "seed pairs": r["seed_pairs"],
        "cases": r["n_cases"], "mean": tables.fmt_ci(r["mean_diff"], r["ci_low"], r["ci_high"]),
        "median": f"{r['median_diff']:+.3f}", "higher/lower/tied": f"{r['cases_higher']}/{r['cases_lower']}/"
        f"{r['cases_tied']}", "sign p": f"{r['sign_p']:.3g}", "per seed pair": r["per_pair"]}
        for _, r in contrasts.iterrows()])
    _listed(rep, name, title, caption, contrasts, shown,
            "no cohort with flip_test runs of both arms of a locked contrast", columns=flip_tables.CONTRAST_COLUMNS)
    _flip_causal(rep, every, cases, n_resamples, seed)


def _flip_causal(rep: Report, runs: pd.DataFrame, cases: pd.DataFrame, n_resamples: int, seed: int) -> None:
    """Table 55's two parts from the clean HF and masked flip_test runs (``runs``: every
    classified flip_test run; ``cases``: their ``flip_cases`` tables)."""
    causal, interaction = pd.DataFrame(), pd.DataFrame()
    hf = runs[runs["kind"] != flip_tables.BEHAVIOUR] if not runs.empty else runs
    if not hf.empty:
        causal = flip_tables.flip_causal_table(runs, cases, n_resamples=n_resamples, seed=seed)
        interaction = flip_tables.flip_interaction_table(runs, cases, n_resamples=n_resamples, seed=seed)
    name, title = "table55_flip_causal", "Table 55: the evidence-flip test, causal half"
    caption = ("Per checkpoint and nominated head set, on the HF generation path with a clean prefill: D on the "
               "clean path, the loss of directional sensitivity ΔD = D_clean - D_masked under the target (evidence) "
               "and the sham (token-matched) decode-time key mask, and target minus sham (per case D_sham - "
               "D_target), means with case-clustered 95% intervals and the cases higher / lower.")
    shown = pd.DataFrame.from_records([{
        "model": r["model"], "arm": r["arm"], "seed": r["seed"], "heads": r["heads"], "cases": r["n_cases"],
        "D clean": _fmt(r["D_clean"]), "ΔD target": tables.fmt_ci(r["delta_target"], r["delta_target_low"],
                                                                  r["delta_target_high"]),
        "ΔD sham": tables.fmt_ci(r["delta_sham"], r["delta_sham_low"], r["delta_sham_high"]),
        "target - sham": tables.fmt_ci(r["target_minus_sham"], r["target_minus_sham_low"],
                                       r["target_minus_sham_high"]),
        "higher/lower": f"{r['cases_higher']}/{r['cases_lower']}"} for _, r in causal.iterrows()])
    _listed(rep, name, title, caption, causal, shown,
            "no checkpoint with a clean HF flip_test run and a target and a sham run on one head set",
            columns=flip_tables.CAUSAL_COLUMNS)
    name, title = "table55_flip_interaction", "Table 55 (bottom): the training-benefit interaction and the path offsets"
    caption = ("L = G_sham - G_target with G = D_Mistill - D_Vanilla CoT-KD (bf16, seed 0, each on the same head-set "
               "label, their own top-40 in the paper), per case; and each checkpoint's execution-path offset, D on "
               "the generation path minus D on the clean HF path, per case; means with case-clustered 95% intervals.")
    shown = pd.DataFrame.from_records([{
        "statistic": r["statistic"], "model": r["model"], "arm": r["arm"], "heads": r["heads"], "cases": r["n_cases"],
        "estimate": tables.fmt_ci(r["estimate"], r["ci_low"], r["ci_high"]),
        "higher/lower": f"{r['cases_higher']}/{r['cases_lower']}"} for _, r in interaction.iterrows()])
    _listed(rep, name, title, caption, interaction, shown,
            "no masked pair of the interaction's students and no behavioural run beside a clean HF one",
            columns=flip_tables.INTERACTION_COLUMNS)


# ---------------------------------------------------------------------- Tables 16-23
READ_SIDE_STAGES = ("read_side", "key_block", "trace_edit", "note_edit")
READ_SIDE_TABLES: tuple[tuple[str, str, str, str], ...] = (
    ("read_side", "readside_groups", "Table 16: what the decision heads read, by group",
     "Per phase, the region lift of the global top-k, the random panel and the bottom-k (per note: "
     "median over events per head, mean over heads; median over notes), the notes on which the top-k "
     "beats the random panel (sign test), and the top-k's shares on the sink, the inventory lines, the "
     "note, the trace prose and the code prefix."),
    ("read_side", "readside_heads_P1", "Table 17: the chapter (P1) top-k head by head",
     "I_c, median shares on the region, the prose and the sink, region lift, n_eff over inventory "
     "tokens, r across events between the region share and the head's importance, and the family by "
     "the stated rule (region reader / prose reader / mixed)."),
    ("read_side", "readside_heads_P2", "Table 18: the code (P2) top-k head by head", "As Table 17, at P2 events."),
    ("read_side", "readside_heads_P2C", "Table 19: the contrastive (P2C) top-k head by head",
     "As Table 17, at P2C events; r is taken between the share on the near-miss's earlier mentions "
     "and the head's importance."),
    ("key_block", "key_block", "Table 20: blocking what the named heads read",
     "E: the head's mean-ablation effect on the margin (share of events with E above the threshold); "
     "D: the margin lost when the head cannot attend to the keys it is named for, against the "
     "empty-set reference, and to as many matched control keys; share: median D/E over events with E "
     "above the threshold; right: the per-note mean of named minus control with its bootstrap "
     "interval, notes higher / lower and the sign test."),
    ("trace_edit", "trace_edit", "Table 21: editing the earlier mention of the near-miss",
     "Effect = margin under the identity edit minus margin under the replacement (positive: the edit "
     "lowered the margin), per replacement, with the sign and Wilcoxon tests; mediated: the median "
     "share of the change removed when the mediation set is mean-ablated during both reads, over "
     "events whose effect exceeds half a nat; paired rows: neutral minus each code replacement. "
     "Per run, so one row block per model (Table 22 compares the students' blocks)."),
    ("note_edit", "note_edit", "Table 23: editing the note",
     "The contrastive margin's change when the emitted code's distinguishing description words, the "
     "sibling's, matched other-chapter words or matched words in no description are replaced in the "
     "note (identity minus variant), over events with a distinguishing word in the note; per note, "
     "the code's words minus each control with its bootstrap interval and sign test."),
)


def read_side_section(rep: Report, runs: dict[str, pd.DataFrame]) -> None:
    """Tables 16-23 from the newest run of each App. E stage per model (one row block per model)."""
    for stage, name, title, caption in READ_SIDE_TABLES:
        found = runs.get(stage, pd.DataFrame())
        if found.empty:
            frame, why = pd.DataFrame(), f"no FINISHED {stage} runs"
        else:
            frame = _load(rep, found, f"{name}.csv", [], ("run_id", "model"))
            why = "" if not frame.empty else f"the {stage} runs logged no rows for it"
        _listed(rep, f"appE_{name}", title, caption, frame, frame.drop(columns=["run_id"], errors="ignore"), why,
                columns=("model",))
    _readside_patient_collapse(rep, runs.get("read_side", pd.DataFrame()))


def _readside_patient_collapse(rep: Report, runs: pd.DataFrame) -> None:
    """App. C's patient collapse of Table 16's region lifts, per read_side run."""
    name, title = "readside_patient_collapse", "App. C: the read-side lifts with the patient as the unit"
    cols = ["run_id", "model", "phase", "group", "lift.note", "lift.patient", "lift.move", "n_notes", "n_patients"]
    frames: list[pd.DataFrame] = []
    reasons: list[str] = []
    for _, run in (runs.drop_duplicates("run_id").iterrows() if not runs.empty else ()):
        lifts = _load(rep, pd.DataFrame([run]), f"{NOTE_LIFTS}.csv", ["note_id", "phase", "group", "lift"],
                      ("run_id", "model"))
        if lifts.empty:
            reasons.append(f"read_side run {run['run_id'][:8]} has no {NOTE_LIFTS}")
            continue
        try:
            table = compare.readside_patient_collapse(lifts, compare.note_patients(run["run_id"]))
        except MistillInputError as exc:
            reasons.append(f"read_side run {run['run_id'][:8]}: {exc}")
            continue
        table.insert(0, "model", run["model"])
        table.insert(0, "run_id", run["run_id"])
        frames.append(table)
    table = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=cols)
    shown = table.drop(columns=["run_id"]).round(3) if frames else table
    moves = ", ".join(f"{m}: {t['lift.move'].abs().max():.3f}" for m, t in table.groupby("model")) if frames else ""
    _listed(rep, name, title,
            "Per phase and group (global top-k, random panel, bottom-k), the region lift's median over notes "
            "(note) and over patients after averaging each patient's notes (patient), with the move (patient - "
            f"note). Largest move per model: {moves or 'none'}.", table, shown,
            "; ".join(reasons) or ("no FINISHED read_side runs" if runs.empty else ""), columns=cols)


EDIT_REFERENCES: tuple[str, ...] = ("vanilla-bf16", "vanilla-fp32")
"""The Vanilla CoT-KD arms Table 22 sets every other arm against, per student model (besides the
report's reference arm)."""


def student_edits_section(rep: Report, runs: pd.DataFrame, reference_arm: str, n_resamples: int, seed: int) -> None:
    """Table 22: per student model, every arm's trace edits against each Vanilla CoT-KD reference
    (:data:`EDIT_REFERENCES`, the report's reference arm first), per seed pair and pooled."""
    name, title = "table22_student_edits", "Table 22: the trace edits on the students"
    references = tuple(dict.fromkeys([a for a in (reference_arm, *EDIT_REFERENCES) if a]))
    caption = ("Per student model, per note, the mean edit effect over the three replacements on the events both "
               f"arms' runs edited; each arm minus each reference arm ({', '.join(references)}) per seed pair, and "
               "pooled with the note as the cluster (bootstrap-over-notes 95% interval; notes higher / lower; sign "
               "test). The ordering is a property of the trained pair.")
    cols = TABLE_COLUMNS
    students = runs[runs["arm"].notna()] if not runs.empty and "arm" in runs.columns else pd.DataFrame()
    if students.empty:
        return _listed(rep, name, title, caption, pd.DataFrame(), pd.DataFrame(),
                       "no FINISHED trace_edit runs of a trained arm", columns=cols)
    events = _load(rep, students, "trace_edit_events.csv", ["event_id"], ("run_id", "model", "arm", "seed"))
    table = edit_pairs_table(events, references, n_resamples=n_resamples, seed=seed)
    _listed(rep, name, title, caption, table, table,
            "" if len(table) else f"no arm's trace_edit runs pair with a reference arm's ({', '.join(references)})",
            columns=cols)


def _audit_missing(labels: pd.DataFrame | None, runs: pd.DataFrame, stage: str) -> str:
    """Why an audit table has no rows before it reads anything (empty: nothing missing)."""
    if labels is None:
        return "no audit labels given (ReportConfig.audit_labels)"
    return f"no FINISHED {stage} runs" if runs.empty else ""


def audit_shares_section(rep: Report, frames: pd.DataFrame, labels: pd.DataFrame | None) -> None:
    """Table 5 (R-C9): what the earlier mention of the sibling is, from the reader's labels joined
    to the newest ``audit_frame`` run's strata: each label's raw share with its exact binomial 95%
    interval and its share weighted by the eight strata's population sizes."""
    name, title = "table5_audit_labels", "Table 5: the audit of contrastive events"
    caption = ("What the earlier mention of the sibling is, over the labelled events of the audit frame's "
               "stratified draw: raw shares with exact binomial 95% intervals, and shares weighted by the strata's "
               "population sizes (strata by tokenizer alignment, gold status and whether the emitted code reaches "
               "the final answer).")
    cols = ["frame_run", *audit_frame.SHARE_COLUMNS]
    why = _audit_missing(labels, frames, "audit_frame")
    if why:
        return _listed(rep, name, title, caption, pd.DataFrame(), pd.DataFrame(), why, columns=cols)
    run = frames.sort_values("start_time", ascending=False).iloc[0]
    frame = _load(rep, pd.DataFrame([run]), "audit_frame.csv", ["note_id", "event_id", "stratum", "drawn"],
                  ("run_id",))
    if frame.empty:
        return _listed(rep, name, title, caption, pd.DataFrame(), pd.DataFrame(),
                       f"audit_frame run {run['run_id']} has no frame table", columns=cols)
    frame["event_id"] = frame["event_id"].astype(str)
    populations = frame["stratum"].value_counts().to_dict()
    joined = labels.merge(frame[["note_id", "event_id", "stratum"]], on=["note_id", "event_id"], how="left")
    unknown = joined["stratum"].isna()
    if unknown.any():
        rep.notes.append(f"Table 5: {int(unknown.sum())} labelled events are not in audit_frame run "
                         f"{run['run_id']}'s population and are left out.")
    shares = audit_frame.label_shares(joined[~unknown], populations)
    shares.insert(0, "frame_run", run["run_id"])
    shown = pd.DataFrame.from_records([{
        "label": r["label"], "events": r["n"], "share": tables.fmt_ci(r["share"], r["ci_low"], r["ci_high"]),
        "population-weighted": _fmt(r["weighted_share"])} for _, r in shares.iterrows()])
    _listed(rep, name, title, caption, shares, shown, "no labelled event of the frame", columns=cols)


def audit_section(rep: Report, evaluate: pd.DataFrame, own: pd.DataFrame, labels: pd.DataFrame | None) -> None:
    """Table 24: M1 and own-heads knock-in recovery at k=40 on the audited contrastive events, per
    model, arm, precision and seed (an ``evaluate`` run and the ``own_heads`` run of the same key)."""
    name, title = "table24_audited_events", "Table 24: the readouts on the audited contrastive events"
    caption = ("M1 (share of the labeled P2C events where the model's teacher-forced margin favours the "
               "teacher's choice) and own-heads knock-in recovery at k=40 (mean over gated events), on the "
               "verified rejections and on the other labeled events (enumerations and the remaining classes).")
    cols = ["model", "arm", "precision", "seed", "stratum", "m1_n", "m1_p_pos", "knockin_n", "recovery_k40"]
    why = _audit_missing(labels, evaluate, "evaluate")
    if why:
        return _listed(rep, name, title, caption, pd.DataFrame(), pd.DataFrame(), why, columns=cols)
    m1 = _load(rep, evaluate, "m1_events.csv", ["event_id", "kind", "margin"])
    kin = _load(rep, own, "own_heads_knockin_events.csv", ["event_id", "phase", "k", "recovery", "gated"]) \
        if not own.empty else pd.DataFrame()
    if len(kin):
        kin = kin[kin["traces"] == "teacher"]
    rows = []
    for key, m1_run in (m1.groupby(list(query.RUN_KEY), dropna=False, sort=True) if len(m1) else []):
        kin_run = kin
        if len(kin):
            match = pd.Series(True, index=kin.index)
            for col, value in zip(query.RUN_KEY, key):
                match &= kin[col].astype(str) == str(value)
            kin_run = kin[match]
        table = stratified_readouts(labels, m1_run, kin_run, k=40)
        for col, value in reversed(list(zip(query.RUN_KEY, key))):
            table.insert(0, col, value)
        rows.append(table)
    frame = pd.concat(rows, ignore_index=True) if rows else pd.DataFrame(columns=cols)
    _listed(rep, name, title, caption, frame, frame, "" if len(frame) else "no evaluate run logged m1_events",
            columns=cols)


# ---------------------------------------------------------------------- Tables 11 and 15
def characterization_section(rep: Report, client: MlflowClient, extra: ExtraRuns, choices: TableChoices,
                      n_resamples: int, seed: int) -> None:
    runs = extra.attribute
    why = "" if not runs.empty else \
        "no knockin run read names an attribute run (the characterization's ranking)"
    t11, t11d, layers = [], [], []
    for _, run in runs.iterrows():
        try:
            data = characterization.load_calibration(client, run["run_id"], str(run["model"]))
            table = characterization.importance_table(
                data, top_k=choices.importance_heads, profile_k=choices.profile_k,
                n_resamples=n_resamples, seed=seed)
            t11.append(table)
            t11d.append(characterization.importance_display(table))
            layers.append(characterization.layer_table(data, bounds=choices.layer_blocks))
        except MistillInputError as exc:
            why = str(exc)
    cat = (lambda frames: pd.concat(frames, ignore_index=True) if frames else pd.DataFrame())
    _listed(rep, "table11_importance", "Table 11: decision-specific importance of representative "
            "heads",
            f"I_c (nats; mean over notes of per-note I_c) with its percentile bootstrap 95% "
            f"interval over notes ({n_resamples} resamples) and its rank among all heads, per "
            f"phase, for the heads in the top {choices.importance_heads} of any phase; profile: "
            f"the phases in whose top {choices.profile_k} the head ranks (all: shared, one: "
            "specific); P2C raw I: the raw importance, exact where measured, not "
            "NULL-calibrated.", cat(t11), cat(t11d), why,
            ["model", "head", "P1 I_c [95% CI]", "P1 rank", "P2 I_c [95% CI]", "P2 rank",
             "P2C I_c [95% CI]", "P2C rank", "profile", "P2C raw I"])
    layer_frame = cat(layers)
    _listed(rep, "table11_layers", "Table 11 (last row): layers of the chapter top-40",
            "Heads of the P1 top-40 in each block of layers and their share of its summed I_c.",
            layer_frame, layer_frame.drop(columns=["run_id"], errors="ignore"), why,
            ["model", "phase", "top_k", "layers", "n_heads", "share_I_c"])
    t15 = characterization.stability_table(runs) if not runs.empty else pd.DataFrame()
    why15 = why if runs.empty else ("the attribute run logged no split-half stability (it needs "
                                    "notes of at least four patients)")
    _listed(rep, "table15_stability", "Table 15: split-half stability of the head discovery",
            "The I_c ranking on one random half of the patients against the other: medians over "
            "splits of the Spearman correlation over all heads and of the top-k overlaps, and of "
            "each half's top-40 overlap with the full ranking.", t15,
            characterization.stability_display(t15) if not t15.empty else pd.DataFrame(), why15,
            ["model", "phase", *(label for _, label in characterization.STABILITY_COLUMNS)])


# --------------------------------------------------------------------------- Tables 39-42
def _selections(rep: Report, runs: pd.DataFrame, cells: pd.DataFrame
                ) -> list[seltab.Selection]:
    out = []
    for _, run in runs.iterrows():
        mine = cells[cells["run_id"] == run["run_id"]] if not cells.empty else pd.DataFrame()
        doc = query.read_json_artifact(run["run_id"], DECISION)
        sel = seltab.load_selection(run.to_dict(), mine, doc if isinstance(doc, dict) else None)
        out.append(sel)
    return out


def _train_arms(train_runs: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Train run id -> its resolved arm (runs without one left out)."""
    out = {}
    for rid in train_runs:
        arm = run_deviations.resolved_arm(rid, query.run_config(rid))
        if arm is not None:
            out[rid] = arm
    return out


def selection_section(rep: Report, runs: pd.DataFrame, cells: pd.DataFrame, extra: ExtraRuns,
               n_resamples: int, seed: int) -> None:
    sels = _selections(rep, runs, cells)
    none = "no FINISHED select_lambda runs" if runs.empty else ""
    ref = rep.reference_arm
    t39 = seltab.grid_table(sels, extra.evaluate, ref) if sels else pd.DataFrame()
    decisions = " ".join(seltab.decision_summary(s) + "." for s in sels)
    _listed(rep, "table39_selection", "Table 39: the λ selection on the validation notes",
            "Every cell of each selection (*: picked, +: within the tie band of the best) with "
            "the lock's metric and tie-break and its evaluation's valid and cap rates and M1 per "
            f"phase; anchor rows: untrained, teacher and {ref} evaluated on the selection's "
            f"notes. {decisions}".strip(), t39,
            seltab.grid_display(t39) if not t39.empty else pd.DataFrame(),
            none or "the select_lambda runs have no cells",
            ["selection", "cell", "λ_P1", "λ_P2", "state", "metric", "tie-break", "gap"])
    t40 = seltab.dose_response_table(sels, extra.eval_notes, ref, n_resamples=n_resamples,
                                     seed=seed) if sels else pd.DataFrame()
    _listed(rep, "table40_dose_response", "Table 40: dose response of M1 on the validation notes",
            f"Per cell, M1 (share of events with a positive margin, per note) minus {ref}'s on "
            "the selection's notes with events in every phase: mean per-note difference, notes "
            "higher/lower, exact sign-test p.", t40,
            seltab.dose_response_display(t40) if not t40.empty else pd.DataFrame(),
            none or "the select_lambda runs have no cells",
            ["selection", "cell", "phase", "notes", "Δ M1 (mean per note)", "higher/lower",
             "sign p"])
    picked_train = [t for s in sels for t in (extra.evaluate[
        (extra.evaluate["split"] == s.split) & (extra.evaluate["arm"] == s.arm)]["train_run"]
        .dropna().unique() if not extra.evaluate.empty else [])]
    arms = _train_arms(sorted(set(picked_train)))
    levels, pairs, whys = [], [], []
    for sel in sels:
        lv, pr, why = seltab.confirmation_tables(
            sel, extra.evaluate, extra.eval_notes, seltab.selected_train_runs(sel, arms), ref,
            n_resamples=n_resamples, seed=seed)
        levels.append(lv)
        pairs.append(pr)
        if why:
            whys.append(f"{sel.name}: {why}")
    lv = pd.concat(levels, ignore_index=True) if levels else pd.DataFrame()
    pr = pd.concat(pairs, ignore_index=True) if pairs else pd.DataFrame()
    _listed(rep, "table41_confirmation", "Table 41: the selected λ against the reference, "
            "every seed", f"The lock's arm at the picked λ and {ref}, each over its seeds on the "
            "selection's notes (mean ± sd), with the untrained student and the teacher as "
            "anchors.", lv,
            seltab.confirmation_display(lv) if not lv.empty else pd.DataFrame(),
            none or "; ".join(whys) or "no evaluations on the selection's notes",
            ["selection", "row", "seeds", "task micro-F1", "M1 P1", "M1 P2", "M1 P2C"])
    _listed(rep, "table41_paired", "Table 41 (paired): seed-matched comparisons",
            f"The selected arm minus {ref}, seed i against seed i (a one-seed side pairs with "
            "every seed), note-clustered: per note the mean of its seed pairs' differences, then "
            "the tests over notes.", pr,
            tables.paired_display(pr) if not pr.empty else pd.DataFrame(),
            none or "; ".join(whys) or "no paired lines",
            ["model", "arm", "reference", "measure", "seed pairs", "notes", "Δ mean [95% CI]"])
    t42 = pd.concat([seltab.reselection_table(
        s, extra.evaluate, extra.eval_notes, extra.own, _own_teacher(extra.own_notes), ref,
        extra.split, n_resamples=n_resamples, seed=seed) for s in sels], ignore_index=True) \
        if sels else pd.DataFrame()
    _listed(rep, "table42_reselection", "Table 42: the selection's cells on the test notes and "
            "their own heads",
            f"Per cell: the validation metric and tie-break; micro-F1 on the {extra.split} notes "
            "and the own top-40 P2C recovery of the cell's train run; Δ: note-clustered against "
            f"every seed of {ref} at the cell's precision (mean [95% CI]).", t42,
            seltab.reselection_display(t42) if not t42.empty else pd.DataFrame(),
            none or "the select_lambda runs have no cells",
            ["selection", "cell", "val metric", "test micro-F1", "own P2C k40"])


def _own_teacher(own_notes: pd.DataFrame) -> pd.DataFrame:
    return ablation_tables._traces(own_notes, "teacher")


# ------------------------------------------------------------------------------- Table 52
def matched_selection_section(rep: Report, runs: pd.DataFrame, extra: ExtraRuns, n_resamples: int,
                              corpus_resamples: int, seed: int) -> None:
    """Table 52 (App. M.2) from every FINISHED ``select_lambda`` run (``runs``): the matched pairs
    (:func:`analysis.matched_tables.matched_pairs`), their validation cells with the picks at the
    locked and the sensitivity band, the test cells at the picks and the paired comparisons."""
    cols = {"table52_validation": ["arm", "λ", "cell", "state", "val micro-F1", "M1 P2C", "gap to best"],
            "table52_test": ["arm", "λ", "seed", "test micro-F1", "own P2C k40 (random)"],
            "table52_paired": ["comparison", "measure", "seed pairs", "notes", "Δ mean [95% CI]"]}
    cells = _lambda_cells(rep, runs) if not runs.empty else pd.DataFrame()
    sels = _selections(rep, runs, cells) if not runs.empty else []
    pairs = matched.matched_pairs(sels)
    why = ("no FINISHED select_lambda runs" if runs.empty else
           "no two select_lambda runs under one protocol, one of them mistill's (locks identical but for the arm)"
           if not pairs else "")
    band = matched.SENSITIVITY_BAND
    t_val = matched.matched_validation_table(pairs, band=band) if pairs else pd.DataFrame()
    _listed(rep, "table52_validation", "Table 52: matched selection, the validation cells",
            f"Every cell of both selections under one protocol: validation micro-F1, M1 at P2C (the "
            f"tie-break), the full-precision gap to the best; {matched.LOCKED_MARK}: the pick at the "
            f"locked band, {matched.SENSITIVITY_MARK}: the pick of the same rule re-applied with the "
            f"{band:g} band to the cells already run.", t_val,
            matched.matched_validation_display(t_val) if not t_val.empty else pd.DataFrame(), why,
            cols["table52_validation"])
    tests, paired_rows = [], []
    candidates = {str(c) for p in pairs for s in (p.ranked, p.control) for c in s.cells.get("train_run", [])
                  if isinstance(c, str)}
    for frame in (extra.evaluate, extra.own):
        if not frame.empty:
            arms_named = {a for p in pairs for a in (p.ranked.arm, p.control.arm)}
            candidates |= set(frame[frame["arm"].isin(arms_named)]["train_run"].dropna().astype(str))
    arms_of = _train_arms(sorted(candidates)) if pairs else {}
    own_notes = _own_teacher(extra.own_notes)
    for pair in pairs:
        ranked, control = (matched.pick_runs(s, arms_of, extra.evaluate, extra.own, extra.split)
                           for s in (pair.ranked, pair.control))
        tests.append(matched.matched_test_table([ranked, control], own_notes))
        paired_rows.append(matched.matched_paired_table(ranked, control, extra.eval_notes, own_notes,
                                                        n_resamples=n_resamples,
                                                        corpus_resamples=corpus_resamples, seed=seed))
    t_test = pd.concat(tests, ignore_index=True) if tests else pd.DataFrame()
    _listed(rep, "table52_test", "Table 52: matched selection, the test cells at the picks",
            f"Every seed of each family's arm at its pick on the {extra.split} notes: micro-F1 and the "
            "own top-40 P2C knock-in recovery (median over notes, random floor in parentheses, as in "
            "Table 45).", t_test, matched.matched_test_display(t_test) if not t_test.empty else pd.DataFrame(),
            why, cols["table52_test"])
    t_pair = pd.concat(paired_rows, ignore_index=True) if paired_rows else pd.DataFrame()
    _listed(rep, "table52_paired", "Table 52: matched selection, the paired comparisons",
            "Mistill's pick minus the control's, seed i against seed i: per note the mean of its seed "
            "pairs' differences, then the tests over notes (bootstrap 95% interval, notes higher/lower; "
            "per pair: each seed pair's mean difference); corpus micro-F1: the difference of the "
            "seed-averaged corpus-level micro-F1, notes resampled.", t_pair,
            matched.matched_paired_display(t_pair) if not t_pair.empty else pd.DataFrame(), why,
            cols["table52_paired"])


# --------------------------------------------------------------------------- Tables 47-51
def ablations_section(rep: Report, client: MlflowClient, extra: ExtraRuns, cells: pd.DataFrame,
               choices: TableChoices, n_resamples: int, seed: int) -> None:
    cell_train = cell_train_runs(cells, extra.train)
    evaluate = extra.test_runs(extra.evaluate, cell_train)
    own = extra.test_runs(extra.own, cell_train)
    train = extra.train[~extra.train["run_id"].isin(cell_train)] if not extra.train.empty \
        else extra.train
    train = query.latest_runs(train) if not train.empty else train
    ev_notes = extra.eval_notes[extra.eval_notes["run_id"].isin(evaluate["run_id"])] \
        if not extra.eval_notes.empty else extra.eval_notes
    own_notes = extra.own_notes[extra.own_notes["run_id"].isin(own["run_id"])] \
        if not extra.own_notes.empty else extra.own_notes
    t47 = ablation_tables.precision_table(evaluate, ev_notes, train, n_resamples=n_resamples,
                                          seed=seed)
    _listed(rep, "table47_precision", "Table 47: precision control, task side",
            "Test micro-F1, valid and cap rate, mean ± sd over seeds; Δ: paired per-note "
            "micro-F1 difference from each Vanilla CoT-KD arm's seed-averaged notes with its "
            "bootstrap 95% interval.", t47, ablation_tables.precision_display(t47))
    precision_train = train[train["arm"].isin(ablation_tables.PRECISION_ARMS)] \
        if not train.empty else train
    history = {rid: query.metric_history(client, rid, "train/ce")
               for rid in precision_train.get("run_id", [])}
    t48 = ablation_tables.training_ce_table(train, history, choices.ce_steps)
    shown48 = t48.drop(columns=["last_step"]).astype(object).map(
        lambda v: "" if v is None or (isinstance(v, float) and v != v) else
        f"{v:.3f}" if isinstance(v, float) else str(v))
    _listed(rep, "table48_training_ce", "Table 48: training cross-entropy per seed",
            f"Cross-entropy on the trace tokens (train/ce) at optimiser steps "
            f"{', '.join(map(str, choices.ce_steps))} and at the run's last step "
            "(empty: the run logged no value at that step).", t48, shown48)
    arms = ablation_tables.ablation_arms()
    t49, p49 = ablation_tables.own_traces_table(
        own, own_notes, train, [*ablation_tables.PRECISION_ARMS, *arms],
        n_resamples=n_resamples, seed=seed)
    _listed(rep, "table49_own_traces", "Table 49: own-heads knock-in on each student's own traces",
            "P2C knock-in recovery of the own top-k on the arm's own generated traces (mean over "
            "notes, random floor in parentheses; coverage: notes with a measurable own-trace "
            "recovery) beside the teacher-forced cell on the same notes.", t49,
            ablation_tables.own_traces_display(t49))
    _listed(rep, "table49_paired", "Table 49 (bottom): Mistill minus Vanilla CoT-KD on own traces",
            "On the notes both arms have own-trace events for: per seed pair, and note-clustered "
            "over the notes with at least one pair.", p49,
            _own_pairs_display(p49) if not p49.empty else pd.DataFrame(),
            "no own-trace readouts of both mistill and a Vanilla CoT-KD arm",
            ["comparison", "k", "seeds", "notes", "Δ mean [95% CI]"])
    t51 = ablation_tables.ablation_table(own, own_notes, evaluate, ev_notes, train, arms,
                                         n_resamples=n_resamples, seed=seed)
    t50 = ablation_tables.ablation_plan_table(arms, t51, alpha=choices.sign_alpha)
    _listed(rep, "table50_ablation_plan", "Table 50: the ablations and the direction of their "
            "effects", "Each ablation arm, its base and the flags it changes, and its measured "
            "P2C recovery and micro-F1 against Mistill (higher / lower: every Mistill seed's "
            "sign test, or the micro-F1 interval, excludes no difference; level: none does; "
            "mixed otherwise).", t50, t50)
    _listed(rep, "table51_ablations", "Table 51: ablations on each arm's own heads",
            "P2C and P2: own top-40 knock-in recovery, median over notes (mean over seeds), "
            "random floor in parentheses; Δ P2C: per-note paired median difference against "
            "each Mistill seed (sign-test p); vs base: notes higher/lower than the untrained "
            "student; M2: P2C region lift (random); prefix: share on the emitted prefix; "
            "micro-F1 with the paired difference from Mistill's seed-averaged notes [95% "
            "interval].", t51, ablation_tables.ablation_display(t51))
    _pool_carriers(rep, client, own)


POOLS_FILE = "student_pools.json"
OWN_SETS_FILE = "own_heads_sets.json"
RANK_TAGS = {"notes": ("mistill.rank_attribute", "calib/{phase}/n_notes"),
             "events": ("mistill.rank_events", "events/{phase}/realized")}
"""What the carriers table reads of the runs behind an own ranking: the own-heads run's tag naming
the ranking's attribute (events) run, and that run's per-phase note (event) count metric."""


def _rank_counts(client: MlflowClient, run_id: str) -> dict[str, float]:
    """``{"<phase>/notes": n, "<phase>/events": n}`` of the runs behind an own-heads run's
    ranking (empty where a run or a metric is missing)."""
    out: dict[str, float] = {}
    try:
        tags = client.get_run(run_id).data.tags
        for what, (tag, metric) in RANK_TAGS.items():
            if not tags.get(tag):
                continue
            metrics = client.get_run(tags[tag]).data.metrics
            for phase in ablation_tables.CARRIER_PHASES:
                value = metrics.get(metric.format(phase=phase))
                if value is not None:
                    out[f"{phase}/{what}"] = float(value)
    except MlflowException:
        return out
    return out


def _pool_carriers(rep: Report, client: MlflowClient, own: pd.DataFrame) -> None:
    """App. M.3's carriers: the supervised pools and the untrained student's own top-40 among
    each trained arm's own top-40 (:func:`analysis.ablation_tables.pool_carriers_table`)."""
    k = ablation_tables.OWN_K
    sets = {rid: query.read_json_artifact(rid, OWN_SETS_FILE) for rid in own.get("run_id", [])}
    trains = {str(t) for t in own.get("train_run", pd.Series(dtype=object)).dropna() if t}
    pools = {t: query.read_json_artifact(t, POOLS_FILE) for t in sorted(trains)}
    counts = {rid: _rank_counts(client, rid) for rid in own.get("run_id", [])}
    table = ablation_tables.pool_carriers_table(own, pools, sets, counts, k=k)
    _listed(rep, "pool_carriers", "App. M.3: the supervised heads among each arm's carriers",
            f"Per trained arm, seed and phase: of the heads its train run supervised (pool), how many "
            f"are among the trained student's own top-{k} after training (its own-heads ranking), "
            f"and how many of the untrained student's own top-{k} are (the paper's carriers, 27-38 "
            f"of 40); share: over the pool, and over the own top-{k}. Ranking notes / events: "
            "what the trained student's own ranking rests on at that phase.",
            table, ablation_tables.pool_carriers_display(table) if not table.empty else pd.DataFrame(),
            "no own_heads runs of a trained arm", list(ablation_tables.CARRIER_COLUMNS))


def _own_pairs_display(table: pd.DataFrame) -> pd.DataFrame:
    out = []
    for _, r in table.iterrows():
        out.append({"comparison": r["comparison"], "k": int(r["k"]), "seeds": r["seeds"],
                    "notes": int(r["n"]),
                    "Δ mean [95% CI]": tables.fmt_ci(r["mean_diff"], r["ci_low"], r["ci_high"]),
                    "higher/lower": f"{int(r['n_higher'])}/{int(r['n_lower'])}",
                    "sign p": tables.format_cell(r["sign_p"], p_value=True)})
    return pd.DataFrame.from_records(out)


# ------------------------------------------------------------- two characterizations, patients
def _stacked_table(rep: Report, name: str, title: str, caption: str, rows: Sequence[pd.DataFrame],
                   shown: Sequence[pd.DataFrame]) -> None:
    """Add the table ``name``: the frames of ``rows`` stacked, shown as the frames of ``shown``."""
    rep.tables.append(ReportTable(name, title, caption, pd.concat(rows, ignore_index=True),
                                  pd.concat(shown, ignore_index=True)))


def characterization_compare_section(rep: Report, attribute: pd.DataFrame, knockin: pd.DataFrame,
                                     collapsed: pd.DataFrame, locus: pd.DataFrame | None = None,
                                     read_side: pd.DataFrame | None = None) -> None:
    """Tables 9/35 (two attribute runs' rankings), 35/36 (their knock-in side by side) and App. C's
    patient collapse of the knock-in cells.

    attribute, knockin: the compared attribute runs and their knock-in runs
    (:func:`analysis.characterization_compare.compared_runs`: ``pair``, ``side``, ``label``);
    collapsed: the knock-in runs whose cells are also collapsed to patients. Each table is added
    only when it has rows; otherwise a note says why."""
    what = "Tables 9/35/36 (two characterizations side by side)"
    if attribute.empty:
        _skip(rep, what, "no pair of attribute runs named (report -P compare_attribute_runs=<a>,<b>) "
                         "and none of one model on one events run differing in detach")
    pairs, shown, kin_rows, kin_shown, basis = [], [], [], [], []
    for pair, grp in (attribute.groupby("pair", sort=True) if not attribute.empty else ()):
        a, b = (grp[grp["side"] == s].iloc[0] for s in ("a", "b"))
        sets = {s: query.read_json_artifact(r["run_id"], characterization.HEAD_SETS) for s, r in (("a", a), ("b", b))}
        if not all(isinstance(v, dict) for v in sets.values()):
            _skip(rep, f"{what}, pair {a['label']} / {b['label']}", f"an attribute run lacks {characterization.HEAD_SETS}")
            continue
        labels = {"pair": int(pair), "label_a": a["label"], "label_b": b["label"], "run_a": a["run_id"],
                  "run_b": b["run_id"], "model_a": a["model"], "model_b": b["model"]}
        table = compare.compare_rankings(sets["a"], sets["b"])
        if a["model"] == b["model"] and not table.empty and table["n_heads"].gt(0).any():
            for col, value in reversed(labels.items()):
                table.insert(0, col, value)
            pairs.append(table)
            shown.append(compare.compare_display(table))
        per_note = {s: _load(rep, knockin[(knockin["pair"] == pair) & (knockin["side"] == s)], PER_NOTE_SETS,
                             ["note_id", "phase", "k", "set", "necessity", "recovery"], ("run_id", "model"))
                    if not knockin.empty else pd.DataFrame() for s in ("a", "b")}
        notes = {s: int(f["note_id"].nunique()) if not f.empty else 0 for s, f in per_note.items()}
        side = compare.knockin_side_by_side(per_note["a"], per_note["b"])
        if not side.empty:
            for col, value in reversed(labels.items()):
                side.insert(0, col, value)
            kin_rows.append(side)
            kin_shown.append(compare.knockin_display(side))
        basis.append(f"{a['label']} (run {a['run_id'][:8]}, {a['model']}; knock-in on {notes['a']} notes) "
                     f"against {b['label']} (run {b['run_id'][:8]}, {b['model']}; knock-in on {notes['b']} notes)")
    pairs_text = "; ".join(basis)
    if pairs:
        _stacked_table(rep, "compare_rankings", "Tables 9 and 35: two characterizations' rankings compared",
                       f"Per pair of attribute runs of one model (A against B) and phase: Spearman's rho of the "
                       f"I_c over every head (heads), and the heads shared by their top-8, top-16 and top-40; "
                       f"notes A/B: the notes each run ranked the phase on. Pairs: {pairs_text}.", pairs, shown)
    elif basis:
        _skip(rep, "Tables 9/35 (rankings compared)", "the runs of each pair are of two models (their "
                                                       "knock-in is compared, Table 36)")
    if kin_rows:
        _stacked_table(rep, "compare_knockin", "Tables 35 and 36: two characterizations' global sets side by side",
                       f"Per pair (A against B), phase and k: each run's own global set, knock-in recovery in "
                       f"another note's context and necessity, medians over notes of per-note means with the "
                       f"count-matched random set in parentheses; notes: where the global set beats random / "
                       f"notes compared. Pairs: {pairs_text}.", kin_rows, kin_shown)
    elif basis:
        _skip(rep, "Tables 35/36 (knock-in side by side)", "no compared attribute run has a FINISHED knockin run")
    _compare_locus(rep, attribute, locus if locus is not None else pd.DataFrame())
    _compare_read_side(rep, read_side if read_side is not None else pd.DataFrame())
    _patient_collapse(rep, collapsed)


def _readback_of(rep: Report, knockin: pd.Series, read_side_sets: pd.DataFrame) -> pd.DataFrame:
    """The read-back rows of the newest ``read_side`` run of the same inputs and frozen ranking as
    ``knockin`` (empty when there is none)."""
    if read_side_sets.empty:
        return pd.DataFrame()
    same = read_side_sets[(read_side_sets["attribute_run"] == knockin["attribute_run"])
                          & (read_side_sets["params.sets_run"] == knockin["params.sets_run"])]
    if same.empty:
        return pd.DataFrame()
    return _load(rep, same.head(1), f"{READBACK_NOTES}.csv", ["note_id", "group", "n_share"], ("run_id",))


def _generations_of(rep: Report, knockin: pd.Series, generations: pd.DataFrame) -> pd.DataFrame:
    """The ``generations`` table of the generate run that traced ``knockin``'s inputs (empty when
    there is none)."""
    if generations.empty:
        return pd.DataFrame()
    source = generations[generations["knockin_run"] == knockin["run_id"]]
    if source.empty:
        return pd.DataFrame()
    return _load(rep, source.head(1)[["run_id"]], "generations.csv", ["note_id", "tp", "fp", "fn", "n_gold"],
                 ("run_id",))


def transfer_screen_section(rep: Report, knockin_sets: pd.DataFrame, n_resamples: int, seed: int,
                            k: int = transfer_tables.SCREEN_K,
                            read_side_sets: pd.DataFrame | None = None,
                            generations: pd.DataFrame | None = None) -> None:
    """Table 59 (App. P): per knock-in run of a frozen development ranking on another label space's
    inputs, its coverage and the ranked heads' recovery against random heads at P2C, top-``k``;
    from a ``read_side`` run of the same inputs and ranking (``read_side_sets``), the
    earlier-naming read-back; from the ``generate`` run that traced the inputs (``generations``:
    ``knockin_run, run_id``), the teacher's native micro-F1
    (:func:`analysis.transfer_tables.transfer_screen_table`)."""
    name, title = "table59_transfer_screen", "Table 59: the teacher's ranked heads against random heads"
    caption = ("Per knock-in of the frozen development ranking (sets_run) on the assessment batch or fresh inputs: "
               "coverage; recovery of the ranked P2C top-40 and of count-matched random heads (means over the "
               "evaluable inputs, 95% percentile bootstrap over inputs); ranked minus random per input; necessity; "
               "the ranked set's recovery at the other k read; with a read_side run of the same ranking on the "
               "same inputs, the read-back: the ranked heads' attention share on the alternative's earlier "
               "namings minus that of the random and the bottom panels, paired per input; where a generate run "
               "traced the inputs, the teacher's native micro-F1 on them.")
    read_side_sets = read_side_sets if read_side_sets is not None else pd.DataFrame()
    generations = generations if generations is not None else pd.DataFrame()
    if knockin_sets.empty:
        return _listed(rep, name, title, caption, pd.DataFrame(), pd.DataFrame(),
                       "no FINISHED knockin run of a frozen ranking (knockin -P sets_run=...)",
                       columns=["run_id", "sets_run", *transfer_tables.COLUMNS])
    frames = []
    for _, run in knockin_sets.iterrows():
        rows = _load(rep, pd.DataFrame([run]), PER_NOTE_SETS, ["note_id", "phase", "k", "set", "necessity",
                                                               "recovery"], ("run_id",))
        table = transfer_tables.transfer_screen_table(rows, k=k, n_resamples=n_resamples, seed=seed,
                                                      readback=_readback_of(rep, run, read_side_sets),
                                                      generations=_generations_of(rep, run, generations))
        table.insert(0, "sets_run", run["params.sets_run"])
        table.insert(0, "run_id", run["run_id"])
        frames.append(table)
    table = pd.concat(frames, ignore_index=True)
    _listed(rep, name, title, caption, table, table.round(3),
            "" if len(table) else "the knock-in runs read no P2C rows", columns=list(table.columns))


def _prepared_groups(*runs: pd.DataFrame) -> dict[str, str]:
    """Each note's group (its ``patient_id``: a MuSiQue-Ans base question, a BigCodeBench task) in
    the prepared corpora the runs read (``params.prepare_run``)."""
    prepare_runs = sorted({str(p) for frame in runs if "params.prepare_run" in frame
                           for p in frame["params.prepare_run"].dropna()})
    groups: dict[str, str] = {}
    for run_id in prepare_runs:
        groups.update(compare.prepared_patients(run_id))
    return groups


def public_task_section(rep: Report, own_runs: pd.DataFrame, eval_runs: pd.DataFrame, n_resamples: int,
                        seed: int, flip_runs: pd.DataFrame | None = None) -> None:
    """Tables 56 and 57 (App. O) of a MuSiQue-Ans experiment: readings 1 to 3, Mistill against the
    reference arm (and against RandHeads on recovery and paired correctness), paired by question
    (or evidence pair) over seed pairs with a bootstrap over base-question groups, and the
    per-checkpoint values (:mod:`analysis.public_task_tables`). ``flip_runs``: the experiment's
    ``flip_test`` runs; the behavioural ones on the evidence pairs give reading 3."""
    name56, title56 = "table56_public_task", "Table 56: the public-task extension's readings"
    caption56 = (f"Mistill minus {rep.reference_arm}, seed i against seed i: (1) the own-heads final-line P2 "
                 "recovery at k=40 per question on the common support, and against RandHeads (no criterion); (2) the "
                 "answer F1 per question; (3) the paired correctness per evidence pair (success on the original "
                 "and the flipped input at one sample index), and against RandHeads; means with 95% percentile "
                 "bootstraps over base-question groups, both counts, each seed pair's mean, and the locked "
                 "criterion. Reading 4 (the teacher's evidence-mask gate) comes from key-masked runs.")
    name57, title57 = "table57_public_task_checkpoints", "Table 57: the public-task extension per checkpoint"
    caption57 = ("Per checkpoint: answer F1 and valid-answer rate of its evaluate run; mean own-heads P2 recovery at "
                 "k=40 over the questions its own_heads run recovers; paired correctness over the evidence pairs "
                 "(descriptive).")
    own = _load(rep, own_runs, OWN_HEADS_PER_NOTE, ["note_id", "phase", "k", "recovery_own"]) \
        if not own_runs.empty else pd.DataFrame()
    answers = _load(rep, eval_runs, PER_NOTE_METRICS, ["note_id", "answer_f1"]) \
        if not eval_runs.empty else pd.DataFrame()
    behaviour = flip_tables.behaviour_runs(flip_tables.flip_runs(flip_runs)) \
        if flip_runs is not None and not flip_runs.empty else pd.DataFrame()
    pair_rows = _load(rep, behaviour, "flip_cases.csv", ["case_id", "paired_success", "group"]) \
        if not behaviour.empty else pd.DataFrame()
    if not pair_rows.empty:
        pair_rows["case_id"] = pair_rows["case_id"].astype(str)
    if own.empty and answers.empty and pair_rows.empty:
        for name, title, caption, cols in ((name56, title56, caption56, public_task_tables.READING_COLUMNS),
                                           (name57, title57, caption57, public_task_tables.CHECKPOINT_COLUMNS)):
            _listed(rep, name, title, caption, pd.DataFrame(), pd.DataFrame(),
                    "no FINISHED own_heads or evaluate run with per-question rows", columns=cols)
        return
    groups = _prepared_groups(own_runs, eval_runs)
    readings = public_task_tables.readings_table(own, answers, groups, pair_rows=pair_rows,
                                                 reference=rep.reference_arm, n_resamples=n_resamples, seed=seed)
    _listed(rep, name56, title56, caption56, readings, readings.round(4),
            "" if len(readings) else f"no seed pair of mistill and {rep.reference_arm}",
            columns=list(public_task_tables.READING_COLUMNS))
    checkpoints = public_task_tables.checkpoint_table(own, answers, tables._norm(eval_runs) if not eval_runs.empty
                                                      else eval_runs, pair_rows=pair_rows)
    _listed(rep, name57, title57, caption57, checkpoints, checkpoints.round(3),
            columns=list(public_task_tables.CHECKPOINT_COLUMNS))
    gate = public_task_tables.gate_table(_gate_rows(rep, flip_runs), n_resamples=n_resamples, seed=seed)
    _listed(rep, "table58_evidence_mask_gate", "Table 58: the teacher's evidence-mask gate",
            "The teacher on the evidence pairs, clean and under the prefill-inclusive evidence-key mask over its "
            "nominated heads (sham, target) and over layer-matched random heads (target): the clean paired "
            "correctness P, E_P = P_sham - P_target and E_P^rand = P_random - P_target, in the recorded "
            "equal-group weighting (the mean of per-group means) and the equal-pair sensitivity, with 95% "
            "percentile bootstraps over base-question groups.", gate, gate.round(4),
            "" if len(gate) else "no teacher flip_test runs on the pairs, clean and under the prefill-inclusive mask",
            columns=list(public_task_tables.GATE_COLUMNS))


def _gate_rows(rep: Report, flip_runs: pd.DataFrame | None) -> pd.DataFrame:
    """The teacher's per-pair paired correctness in each setting of the gate (``clean``: its HF run
    without a mask; ``sham``/``target``: the prefill-inclusive mask on its nominated heads;
    ``random<n>``: the target mask on random draw n), from the flip_test runs' ``flip_cases``."""
    every = flip_tables.flip_runs(flip_runs) if flip_runs is not None and not flip_runs.empty else pd.DataFrame()
    if every.empty:
        return pd.DataFrame()
    teacher = every[every["arm"].astype(str) == tables.TEACHER_ARM]
    settings: dict[str, str] = {}
    for _, run in teacher.iterrows():
        heads = str(run["heads"])
        if run["kind"] == flip_tables.CLEAN_HF:
            settings[run["run_id"]] = "clean"
        elif run["kind"] == flip_tables.MASKED and "prefill" in heads.split():
            draw = next((w for w in heads.split() if w.startswith("random")), "")
            if draw and run["mask"] == "target":
                settings[run["run_id"]] = draw
            elif not draw:
                settings[run["run_id"]] = str(run["mask"])
    if not settings:
        return pd.DataFrame()
    chosen = teacher[teacher["run_id"].isin(list(settings))]
    rows = _load(rep, chosen, "flip_cases.csv", ["case_id", "paired_success", "group"], ("run_id",))
    if rows.empty:
        return rows
    rows["case_id"] = rows["case_id"].astype(str)
    return rows.assign(setting=rows["run_id"].map(settings))


def pilot_section(rep: Report, own_runs: pd.DataFrame, eval_runs: pd.DataFrame, n_resamples: int,
                  seed: int) -> None:
    """Table 60 (App. P) of a programming-pilot experiment: the paired own-heads P2C recovery
    contrasts at k = 40 and 29 and the raw knock-in gain, the pass@1 changes and pass@1 per arm and
    seed, and the advancement thresholds' verdict (:mod:`analysis.pilot_tables`). Inputs and tasks
    are resampled by their prepared group (``patient_id``: each BigCodeBench task its own)."""
    name, title = "table60_pilot", "Table 60: the programming pilot's paired contrasts"
    caption = ("Own-heads P2C recovery, seed i against seed i, on the inputs evaluable in both arms at both seeds: "
               "the seed-averaged median over inputs, the mean with a 95% percentile bootstrap resampling "
               "near-duplicate groups, inputs above zero and each seed pair's median; k=40 primary, k=29 "
               "sensitivity; the raw knock-in gain in nats at k=40. The author's thresholds, fixed before the "
               "outcome, in the last columns.")
    pname, ptitle = "table60_pilot_pass_at_1", "Table 60 (pass@1): the pilot's development tasks"
    pcaption = ("pass@1 changes on the development tasks (seed-averaged per task, the mean with a bootstrap over "
                "tasks; the seed columns are mean pass-rate changes), then pass@1 per arm and seed with the tasks "
                "holding a terminal sandbox result, and the verdict of the advancement thresholds.")
    own = _load(rep, own_runs, OWN_HEADS_PER_NOTE, ["note_id", "phase", "k", "recovery_own"]) \
        if not own_runs.empty else pd.DataFrame()
    if not own.empty:
        own = own[own["traces"] == "teacher"] if "traces" in own else own  # teacher-forced on the teacher's traces
    answers = _load(rep, eval_runs, PER_NOTE_METRICS, ["note_id", "passed", "verdict"]) \
        if not eval_runs.empty else pd.DataFrame()
    groups = _prepared_groups(own_runs, eval_runs)
    recovery = pilot_tables.recovery_table(own, groups, n_resamples=n_resamples, seed=seed)
    _listed(rep, name, title, caption, recovery, recovery.round(4),
            "" if len(recovery) else "no seed pair of two pilot arms with own-heads P2C rows",
            columns=list(pilot_tables.RECOVERY_COLUMNS))
    passes = pilot_tables.pass_table(answers, groups, n_resamples=n_resamples, seed=seed)
    arms = pilot_tables.arm_pass_table(answers) if not answers.empty else \
        pd.DataFrame(columns=list(pilot_tables.ARM_PASS_COLUMNS))
    verdict = pilot_tables.pilot_verdict(recovery, passes, arms)
    rows = [*({"panel": "change", **r} for r in passes.to_dict("records")),
            *({"panel": "per arm", **r} for r in arms.to_dict("records")),
            *({"panel": "verdict", "arm": key, "met": value} for key, value in verdict.items())]
    table = pd.DataFrame(rows) if passes.size or arms.size else pd.DataFrame()
    _listed(rep, pname, ptitle, pcaption, table, table.round(4) if len(table) else table,
            "" if len(table) else "no FINISHED evaluate run with per-task sandbox verdicts",
            columns=["panel", *pilot_tables.PASS_COLUMNS])


def instruction_control_section(rep: Report, client: MlflowClient, knockin_sets: pd.DataFrame) -> None:
    """Table 4 (App. B): per knock-in run of another characterization's global sets
    (``knockin -P sets_run=...``), the instruction control's four readings."""
    name, title = "table4_instruction_control", "Table 4: the instruction control's four readings"
    caption = ("Per knock-in of a reference characterization's global sets (sets_run, the paper: HD-001) into "
               "regenerated traces: (1) notes where the reference's top-8 beats random there, and its top-40 "
               "recovery against the reference's own on the notes both read; (2) heads the re-ranked top-40 / "
               "top-8 share with the reference's; (3) the share of chapter mentions with a window locus; (4) "
               "heads the new prose-time top-8 shares with its chapter top-8 and with the reference's prose-time "
               "top-8.")
    cols = ["run_id", "model", "reading", "phase", "statistic", "value", "reference"]
    if knockin_sets.empty:
        return _listed(rep, name, title, caption, pd.DataFrame(), pd.DataFrame(),
                       "no FINISHED knockin run of another run's sets (knockin -P sets_run=...)", columns=cols)
    frames = []
    for _, run in query.latest_runs(knockin_sets, ("model",)).iterrows():
        new_att, ref_att = run["attribute_run"], run["params.sets_run"]
        rows = _load(rep, pd.DataFrame([run]), PER_NOTE_SETS, ["note_id", "phase", "k", "set", "necessity", "recovery"],
                     ("run_id",))
        ref_kin = compare.newest_reader(client, ref_att, "knockin")
        ref_rows = _load(rep, pd.DataFrame([{"run_id": ref_kin}]), PER_NOTE_SETS, ["note_id", "phase", "k", "set",
                                                                                  "necessity", "recovery"],
                         ("run_id",)) if ref_kin else pd.DataFrame()
        loci = {side: compare.newest_reader(client, att, "locus") for side, att in (("new", new_att), ("ref", ref_att))}
        window = tuple(float(client.get_run(loci[side]).data.metrics.get("locus/share_window", float("nan")))
                       if loci[side] else float("nan") for side in ("new", "ref"))
        sets = {side: query.read_json_artifact(att, characterization.HEAD_SETS) or {}
                for side, att in (("new", new_att), ("ref", ref_att))}
        locus_sets = {side: query.read_json_artifact(loci[side], characterization.HEAD_SETS) if loci[side] else None
                      for side in ("new", "ref")}
        table = compare.instruction_control_table(rows, ref_rows, sets["ref"], sets["new"], locus_sets["new"],
                                                  locus_sets["ref"], window)
        table.insert(0, "model", run["model"])
        table.insert(0, "run_id", run["run_id"])
        frames.append(table)
    table = pd.concat(frames, ignore_index=True)
    _listed(rep, name, title, caption, table, table.drop(columns=["run_id"]).round(3), columns=cols)


def _compare_locus(rep: Report, attribute: pd.DataFrame, locus: pd.DataFrame) -> None:
    """Tables 35 and 37's locus rows: per pair of compared characterizations, their locus runs'
    metrics side by side, the prose-time and transport rankings compared (same model), and each
    prose-time set's overlap with its own chapter set and its median layer."""
    if attribute.empty:
        return
    if locus.empty:
        return _skip(rep, "Tables 35/37 (locus side by side)", "no compared attribute run has a FINISHED locus run")
    frames = [compare.metrics_side_by_side(locus, "locus")]
    for pair, grp in locus.groupby("pair", sort=True):
        sides = {r["side"]: r for _, r in grp.iterrows()}
        if set(sides) != {"a", "b"}:
            continue
        sets = {s: query.read_json_artifact(r["run_id"], characterization.HEAD_SETS) for s, r in sides.items()}
        att = {s: query.read_json_artifact(r["run_id"], characterization.HEAD_SETS)
               for s, r in attribute[attribute["pair"] == pair].set_index("side").iterrows()}
        extra = {}
        if all(isinstance(v, dict) for v in sets.values()):
            if sides["a"]["model"] == sides["b"]["model"]:
                for _, r in compare.compare_rankings(sets["a"], sets["b"], phases=compare.LOCUS_RANKINGS).iterrows():
                    extra[f"{r['phase']}/spearman"] = (r["spearman"], r["spearman"])
                    for k in compare.COMPARE_KS:
                        extra[f"{r['phase']}/top_overlap/{k}"] = (r[f"top_overlap.{k}"], r[f"top_overlap.{k}"])
            both = {s: compare.prose_time_overlap(sets[s], att.get(s) if isinstance(att.get(s), dict) else {})
                    for s in ("a", "b")}
            for key in sorted(set(both["a"]) | set(both["b"])):
                extra[f"prose_time/{key.replace('.', '/').replace('overlap', 'chapter_overlap')}"] = \
                    (both["a"].get(key, float("nan")), both["b"].get(key, float("nan")))
        a, b = sides["a"], sides["b"]
        frames.append(pd.DataFrame([{"pair": int(pair), "label_a": a["label"], "label_b": b["label"],
                                     "run_a": a["run_id"], "run_b": b["run_id"], "metric": name, "a": float(va),
                                     "b": float(vb), "b_minus_a": float(vb) - float(va)}
                                    for name, (va, vb) in extra.items()]))
    table = pd.concat([f for f in frames if not f.empty], ignore_index=True) if any(not f.empty for f in frames) \
        else pd.DataFrame()
    if table.empty:
        return _skip(rep, "Tables 35/37 (locus side by side)", "the compared locus runs logged no locus metrics")
    rep.tables.append(ReportTable(
        "compare_locus", "Tables 35 and 37: two characterizations' locus side by side",
        "Per pair (A against B): each locus run's outcome shares, median window distance, pass B and "
        "follow-through (locus/...), the prose-time and transport rankings compared where both runs are "
        "of one model (Spearman's rho, heads shared by the top-k; the same value in both columns), and "
        "each prose-time set's heads shared with its own characterization's chapter set and its median "
        "layer (prose_time/chapter_overlap/<k>, prose_time/median_layer).",
        table, table.drop(columns=["run_a", "run_b"]).round(3)))


def _compare_read_side(rep: Report, read_side: pd.DataFrame) -> None:
    """Table 35's read-side rows: the read_side runs of two compared characterizations side by side."""
    if read_side.empty:
        return
    table = compare.metrics_side_by_side(read_side, "read_side")
    if table.empty:
        return _skip(rep, "Table 35 (read side side by side)", "the compared read_side runs logged no readside metrics")
    rep.tables.append(ReportTable(
        "compare_read_side", "Table 35: two characterizations' read side side by side",
        "Per pair (A against B): each read_side run's region lifts of the top-k, random and bottom-k groups "
        "per phase, and the sign-test p of the top-k against the random panel (readside/...).",
        table, table.drop(columns=["run_a", "run_b"]).round(3)))


def _patient_collapse(rep: Report, runs: pd.DataFrame) -> None:
    what = "App. C's patient collapse of the knock-in cells"
    if runs.empty:
        return _skip(rep, what, "no FINISHED knockin runs")
    frames, shown, units = [], [], []
    for _, run in runs.drop_duplicates("run_id").iterrows():
        try:
            patients = compare.note_patients(run["run_id"])
        except MistillInputError as exc:
            _skip(rep, f"{what}, run {run['run_id']}", str(exc))
            continue
        rows = _load(rep, pd.DataFrame([run]), PER_NOTE_SETS,
                     ["note_id", "phase", "k", "set", "necessity", "recovery"], ("run_id", "model"))
        if rows.empty:
            continue
        try:
            table = compare.patient_collapse_table(rows, patients)
        except MistillInputError as exc:
            _skip(rep, f"{what}, run {run['run_id']}", str(exc))
            continue
        table.insert(0, "model", run["model"])
        table.insert(0, "run_id", run["run_id"])
        frames.append(table)
        shown.append(compare.patient_collapse_display(table))
        move = table.loc[table["set"] == "global", "recovery.move"].abs().max()
        units.append(f"{run['model']} (run {run['run_id'][:8]}): {int(table['n_notes'].iloc[0])} notes of "
                     f"{int(table['n_patients'].iloc[0])} patients, largest move of a global knock-in "
                     f"median {move:.3f}")
    if not frames:
        return
    rep.tables.append(ReportTable(
        "patient_collapse", "App. C: the knock-in cells with the patient as the unit",
        "Tables 1/10 twice: medians over notes of per-note means (note), and over patients after "
        "averaging each patient's per-note means (patient), with the move (patient - note); for the "
        "global set the notes / patients where it beats random. " + "; ".join(units) + ".",
        pd.concat(frames, ignore_index=True), pd.concat(shown, ignore_index=True)))


# --------------------------------------------------- Table 53, Figure 8 and the training cost
def _train_run_info(train: pd.DataFrame) -> pd.DataFrame:
    """The train runs (read with their ``params.train_notes`` column) with the param resolved to a
    size (``train_notes``: :func:`analysis.training_tables.train_sizes`) and the run's wall
    seconds (``run_seconds``)."""
    asked = dict(zip(train["run_id"].astype(str), train["params.train_notes"]))
    out = train.copy()
    sizes = training_tables.train_sizes(train, asked)
    out["train_notes"] = out["run_id"].astype(str).map(sizes).astype("Int64")
    ended = pd.to_numeric(out["end_time"], errors="coerce")
    started = pd.to_numeric(out["start_time"], errors="coerce")
    out["run_seconds"] = ((ended - started) / 1000).where((ended > 0) & (started > 0))
    return out


def _cost_history(client: MlflowClient, train: pd.DataFrame) -> pd.DataFrame:
    """The cost metrics' values of every train run, long (``run_id, metric, step, value``)."""
    gpu = [c for c in train.columns if training_tables.SYSTEM_GPU_MEMORY.match(str(c))]
    rows = []
    for _, run in train.iterrows():
        logged = [m for m in training_tables.COST_METRICS if m in train.columns and not pd.isna(run[m])]
        logged += [m for m in gpu if not pd.isna(run[m])]
        for metric in logged:
            rows += [{"run_id": run["run_id"], "metric": metric, "step": step, "value": value}
                     for step, value in query.metric_history(client, run["run_id"], metric).items()]
    return pd.DataFrame.from_records(rows, columns=["run_id", "metric", "step", "value"])


def training_section(rep: Report, client: MlflowClient, extra: ExtraRuns, cells: pd.DataFrame,
                     n_resamples: int, seed: int) -> None:
    """Table 53 and Figure 8 (the learning curve) and App. I.5's training cost per arm."""
    if extra.train.empty:
        _skip(rep, "Table 53 (learning curve), Figure 8 and the training cost", "no FINISHED train runs")
        return
    train = _train_run_info(extra.train)
    cell_train = cell_train_runs(cells, extra.train)
    evaluate = extra.evaluate
    if not evaluate.empty:
        evaluate = evaluate[(evaluate["split"].isna() | (evaluate["split"] == extra.split))
                            & ~evaluate["train_run"].isin(cell_train)]
    sizes = {str(r): int(n) for r, n in zip(train["run_id"], train["train_notes"]) if not pd.isna(n)}
    runs = training_tables.learning_curve_runs(evaluate, sizes)
    per_note = extra.eval_notes[extra.eval_notes["run_id"].isin(runs["run_id"])] \
        if not extra.eval_notes.empty and not runs.empty else pd.DataFrame(columns=["run_id", "seed", "note_id"])
    references = [a for a in dict.fromkeys([rep.reference_arm, *ablation_tables.VANILLA_ARMS])
                  if a != ablation_tables.MISTILL_ARM]
    t53 = training_tables.learning_curve_table(runs, per_note, references=references,
                                               n_resamples=n_resamples, seed=seed)
    what = "Table 53 (learning curve) and Figure 8"
    if t53.empty:
        _skip(rep, what, f"no {extra.split} evaluate run of a {ablation_tables.MISTILL_ARM} or Vanilla CoT-KD "
                         "checkpoint whose train run's size (train_notes, n_notes) is known")
    else:
        sizes_read = sorted({int(s) for s in t53["train_notes"]})
        rep.tables.append(ReportTable(
            "table53_learning_curve", "Table 53: learning curve",
            f"{ablation_tables.MISTILL_ARM} and Vanilla CoT-KD trained on {', '.join(map(str, sizes_read))} "
            f"training notes, evaluated on the same {int(per_note['note_id'].nunique())} {extra.split} notes "
            f"({len(runs)} evaluate runs): micro-F1 (corpus-level) and M1 at P2C, mean ± sd over seeds; "
            f"against each Vanilla CoT-KD arm at the same size, seed i against seed i (a one-seed side pairs "
            f"with every seed), the per-note difference note-clustered (mean [95% bootstrap interval, "
            f"{n_resamples} resamples]) and the notes, or note-pairs pooled over seed pairs and counted as if "
            "independent (descriptive), on which the arm is higher / lower, with their exact sign test.",
            t53, training_tables.learning_curve_display(t53)))
        rep.figures["learning_curve"] = training_tables.learning_curve_figure(t53, "Learning curve (Figure 8)")
    cost_runs = training_tables.training_cost_runs(train, _cost_history(client, train))
    cost = training_tables.training_cost_table(cost_runs, rep.reference_arm)
    timed = cost_runs[cost_runs["steps_timed"] > 0] if not cost_runs.empty else cost_runs
    if timed.empty:
        _skip(rep, "The training cost per arm", "no train run logged its steps' cost (train/step_seconds)")
        return
    rep.tables.append(ReportTable(
        "training_cost_runs", "App. I.5: training cost per run",
        f"Each of the {len(cost_runs)} train runs: the optimizer steps timed, their summed and median wall "
        "seconds, seconds per note trained (summed step seconds over the notes of those steps), the run's "
        "wall minutes (loading and saving included) and its peak memory (the steps' torch peak on the device, "
        "else MLflow's sampled GPU memory).", cost_runs, training_tables.training_cost_runs_display(cost_runs)))
    rep.tables.append(ReportTable(
        "training_cost", "App. I.5: training cost per arm",
        f"Per arm, precision and number of training notes, over its runs ({len(cost_runs)} train runs, "
        f"{len(timed)} with timed steps): seconds per note and per optimizer step, training and run minutes "
        f"(min–max over runs), the largest peak memory; with and without the Mistill terms: the arm's mean "
        f"seconds per note over {rep.reference_arm}'s on as many notes, and the difference of their peaks. "
        "Hardware-dependent, indicative only.", cost, training_tables.training_cost_display(cost, rep.reference_arm)))


# ------------------------------------------------------------------- App. L.5, L.6: replicates
def _pair_frames(extra: ExtraRuns, rid: str) -> tuple[str, pd.DataFrame, pd.Series] | None:
    """A paired run's stage, per-note rows and run row (None: no FINISHED evaluate or
    own_heads run of the experiment)."""
    for stage, runs, notes in (("evaluate", extra.evaluate, extra.eval_notes),
                               ("own_heads", extra.own, extra.own_notes)):
        if not runs.empty and (runs["run_id"] == rid).any():
            mine = notes[notes["run_id"] == rid] if not notes.empty else notes
            return stage, mine, runs[runs["run_id"] == rid].iloc[0]
    return None


def _same_checkpoint(a: pd.Series, b: pd.Series) -> bool:
    for col in ("train_run", "checkpoint"):
        if col in a.index and isinstance(a[col], str) and a[col]:
            return a[col] == b.get(col)
    return False


def _pair_measure(frame: pd.DataFrame, keys: Sequence[str]) -> pd.Series:
    """The figure's panel of a row: the measure, with the traces, phase and k of an own-heads pair."""
    if not keys:
        return frame["measure"]
    return frame["measure"] + " (" + frame["traces"].astype(str) + ", " + frame["phase"].astype(str) \
        + ", k=" + frame["k"].astype(int).astype(str) + ")"


def replicate_section(rep: Report, extra: ExtraRuns, pairs: Sequence[tuple[str, str]], n_resamples: int,
                      seed: int) -> None:
    """App. L.5 and L.6: the replicate pairs (``ReportConfig.replicate_runs``) paired note by note."""
    what = "The replicate pairing (App. L.5, L.6)"
    if not pairs:  # nothing asked for
        return None
    tables_, diffs, summaries = [], [], []
    for i, (a, b) in enumerate(pairs, start=1):
        found = {rid: _pair_frames(extra, rid) for rid in (a, b)}
        if any(v is None for v in found.values()):
            missing = [rid for rid, v in found.items() if v is None]
            rep.notes.append(f"replicate pair {i}: {', '.join(missing)} is no FINISHED evaluate or own_heads run "
                             "of this experiment")
            continue
        (stage_a, notes_a, run_a), (stage_b, notes_b, run_b) = found[a], found[b]
        if stage_a != stage_b:
            rep.notes.append(f"replicate pair {i}: a {stage_a} run paired with a {stage_b} run")
            continue
        if stage_a == "evaluate":
            keys: tuple[str, ...] = ()
            long = training_tables.replicate_differences(notes_a, notes_b, training_tables.EVALUATE_MEASURES)
        else:
            keys = ("traces", "phase", "k")
            notes_a, notes_b = (n.assign(traces=n["traces"].fillna("teacher")) if "traces" in n.columns
                                else n.assign(traces="teacher") for n in (notes_a, notes_b))
            long = training_tables.replicate_differences(
                notes_a, notes_b, [(training_tables.OWN_HEADS_MEASURE, "M4 own top-k recovery")], keys)
        table = training_tables.replicate_table(long, keys, n_resamples=n_resamples, seed=seed)
        if table.empty:
            rep.notes.append(f"replicate pair {i}: the two runs share no note with a value")
            continue
        if stage_a == "own_heads":
            sets = [query.read_json_artifact(r, OWN_SETS_FILE) for r in (a, b)]
            agree = [training_tables.top_k_agreement(*sets, r["phase"], int(r["k"])) for _, r in table.iterrows()]
            table = table.assign(top_k_overlap=[g.get("top_k_overlap") for g in agree],
                                 same_order=[g.get("same_order") for g in agree])
        names = [str(r.get("run_name") or r["run_id"]) for r in (run_a, run_b)]
        front = {"pair": i, "stage": stage_a, "run_a": a, "run_b": b, "run_a_name": names[0],
                 "run_b_name": names[1], "same_checkpoint": _same_checkpoint(run_a, run_b)}
        for col, value in reversed(list(front.items())):
            table.insert(0, col, value)
        tables_.append(table)
        model = str(run_a.get("model"))
        diffs.append(long.assign(model=model, comparison=f"pair {i}: a - b",
                                 measure=_pair_measure(long, keys)))
        summaries.append(table.assign(model=model, arm=f"pair {i}: a", reference="b",
                                      measure=_pair_measure(table, keys)))
    if not tables_:
        return _skip(rep, what, "no replicate pair could be read")
    table = pd.concat(tables_, ignore_index=True)
    n_notes = int(table["n"].max())
    rep.tables.append(ReportTable(
        "replicate_pairs", "App. L.5, L.6: replicate pairing",
        f"{len(tables_)} pair(s) of runs of one configuration (a same-seed replicate, or one checkpoint read "
        f"twice), up to {n_notes} notes per measure: per note run a minus run b, each run's mean (median) over "
        f"the paired notes, the mean difference with its bootstrap 95% interval ({n_resamples} resamples), the "
        "median difference, notes higher/lower/tied, exact sign-test and Wilcoxon p; for own-heads pairs per "
        "traces, phase and k, and how many of the own top-k the two rankings share (in the same order or not). "
        "Two readings agree when the differences centre on zero at a spread below the effects read elsewhere.",
        table, training_tables.replicate_display(table)))
    rep.figures["replicate_differences"] = figures.paired_differences_figure(
        pd.concat(diffs, ignore_index=True), pd.concat(summaries, ignore_index=True),
        "Replicate pairs: per-note differences", "run a minus run b; red: mean with its bootstrap 95% interval")
