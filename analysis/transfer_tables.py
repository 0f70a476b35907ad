"""Table 59 (App. P): the teacher's ranked heads on another label space, against random heads.

The teacher's heads are ranked once on a development batch (an ``attribute`` run), and that
frozen ranking's global sets are knocked in on other inputs (``knockin -P sets_run=<the ranking>``
on the assessment batch or on fresh inputs). From such a knock-in run's ``per_note_sets`` rows,
at the contrastive decision (P2C) and k = 40 (:data:`SCREEN_PHASE`, :data:`SCREEN_K`):

* coverage: the inputs with an event of the phase, the evaluable inputs (a recovery for both the
  ranked and the random set: at least one event whose all-heads-minus-corrupt range passed the
  gate), and the evaluable events against all the phase's events;
* recovery of the ranked (global) set and of the count-matched random heads, means over the
  evaluable inputs with 95 % percentile bootstraps over inputs;
* ranked minus random per input (paired), its mean, bootstrap interval and the inputs where it is
  positive; necessity of both sets (the normalised margin loss under their ablation);
* the ranked set's recovery at every other k the run read (the paper quotes k = 100);
* with a ``read_side`` run of the same frozen ranking on the same inputs (``read_side
  -P sets_run=<the ranking>``), the earlier-naming read-back diagnostic: per input, the ranked P2C
  heads' mean attention share on the alternative's earlier namings (``N``) minus that of each
  control panel (count-matched random heads, the bottom of the ranking), its mean with a 95 %
  percentile bootstrap over inputs and the inputs where the ranked heads read more;
* where the inputs' traces are a ``generate`` run's, the teacher's native micro-F1 there (its
  own answers against the inputs' gold labels, pooled, with a percentile bootstrap over inputs),
  or, for programming, its pass@1 (its code run against each problem's tests in the sandbox);
  beside the micro-F1, the same inputs' retrieval baseline (the top-5 of a retrieval ranking) where
  the ``generate`` run graded one.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from mistill import stats
from mistill.stages.generate import RETRIEVAL_COUNTS

__all__ = ["SCREEN_PHASE", "SCREEN_K", "TRANSFER_TASKS", "COLUMNS", "READBACK_CONTROLS", "native_table",
           "readback_table", "transfer_screen_table"]

SCREEN_PHASE, SCREEN_K = "P2C", 40
"""The cell Table 59 reads: the contrastive decision's top-40."""
TRANSFER_TASKS: tuple[str, ...] = ("eurlex57k", "bigcodebench")
"""The label spaces of App. P's screen whose corpora the stages read (the report lists Table 59
for their experiments instead of the clinical instruction control)."""
COLUMNS: list[str] = ["statistic", "k", "value", "ci_low", "ci_high", "n"]
READBACK_CONTROLS: tuple[str, ...] = ("random", "bottom")
"""The panels the ranked heads' read-back is paired against (the read side's ``random`` and
``bottom`` groups)."""


def _cell(rows: pd.DataFrame, phase: str, k: int, which: str) -> pd.DataFrame:
    got = rows[(rows["phase"] == phase) & (rows["k"] == k) & (rows["set"] == which)]
    return got.drop_duplicates("note_id").set_index("note_id")


def readback_table(notes: pd.DataFrame, *, k: int = SCREEN_K, n_resamples: int = stats.N_BOOTSTRAP,
                   seed: int = 0) -> pd.DataFrame:
    """The read-back rows of Table 59 (:data:`COLUMNS`) from a ``read_side`` run's
    ``readside_readback_notes`` (``note_id, group, n_share``): the ranked heads' mean share on
    ``N`` over the inputs, then per control of :data:`READBACK_CONTROLS` the paired difference
    ranked minus control over the inputs with both, and the inputs where it is positive. ``k`` is
    the panel size the row is labelled with."""
    out: list[dict] = []
    if notes.empty:
        return pd.DataFrame(columns=COLUMNS)
    wide = notes.assign(note_id=notes["note_id"].astype(str)).pivot_table(
        index="note_id", columns="group", values="n_share", aggfunc="first")
    if "top" not in wide:
        return pd.DataFrame(columns=COLUMNS)
    top = pd.to_numeric(wide["top"], errors="coerce").dropna()
    out.append({"statistic": "read-back on the earlier namings, ranked heads", "k": k, "value": float(top.mean()),
                "ci_low": math.nan, "ci_high": math.nan, "n": len(top)})
    for control in READBACK_CONTROLS:
        if control not in wide:
            continue
        pair = wide[["top", control]].apply(pd.to_numeric, errors="coerce").dropna()
        if pair.empty:
            continue
        d = stats.paired_difference(pair["top"].to_numpy(), pair[control].to_numpy(), n_resamples=n_resamples,
                                    seed=seed)
        out.append({"statistic": f"read-back, ranked minus {control}", "k": k, "value": d.mean_diff,
                    "ci_low": d.ci_low, "ci_high": d.ci_high, "n": d.n})
        out.append({"statistic": f"inputs where the ranked heads read back more than {control}", "k": k,
                    "value": float(d.n_higher), "ci_low": math.nan, "ci_high": math.nan, "n": d.n})
    return pd.DataFrame(out, columns=COLUMNS)


def native_table(generations: pd.DataFrame, *, k: int = SCREEN_K, n_resamples: int = stats.N_BOOTSTRAP,
                 seed: int = 0) -> pd.DataFrame:
    """The native row of Table 59 (:data:`COLUMNS`) from a ``generate`` run's ``generations``
    (``tp, fp, fn, n_gold`` per input): the pooled micro-F1 of the inputs with gold labels and
    its percentile bootstrap over them (empty without such inputs); for executed answers
    (BigCodeBench: ``verdict`` and ``passed`` per input), pass@1 over every input with its
    percentile bootstrap, and the inputs whose generation held no code, in its place. Where the
    table grades a retrieval baseline on the same inputs (``retrieval_tp, retrieval_fp,
    retrieval_fn``, its top ``retrieval_top``: EURLEX57K), that baseline's pooled micro-F1 and
    bootstrap follow the teacher's."""
    if "passed" in generations.columns and len(generations):
        passed = pd.to_numeric(generations["passed"], errors="coerce").to_numpy(dtype=float)
        ci = stats.bootstrap_ci(passed, n_resamples=n_resamples, seed=seed)
        no_code = int((generations.get("verdict", pd.Series(dtype=str)) == "no_code").sum())
        return pd.DataFrame([{"statistic": "native pass@1 of the teacher's code (sandboxed tests)", "k": k,
                              "value": ci.estimate, "ci_low": ci.low, "ci_high": ci.high, "n": len(passed)},
                             {"statistic": "inputs whose generation held no code", "k": k, "value": no_code,
                              "ci_low": math.nan, "ci_high": math.nan, "n": len(passed)}], columns=COLUMNS)
    if generations.empty or not {"tp", "fp", "fn", "n_gold"} <= set(generations.columns):
        return pd.DataFrame(columns=COLUMNS)
    graded = generations[pd.to_numeric(generations["n_gold"], errors="coerce") > 0]
    if graded.empty:
        return pd.DataFrame(columns=COLUMNS)
    ci = stats.corpus_micro_f1(graded[["tp", "fp", "fn"]].to_numpy(dtype=int), n_resamples=n_resamples, seed=seed)
    rows = [{"statistic": "native micro-F1 of the teacher's answers", "k": k, "value": ci.estimate,
             "ci_low": ci.low, "ci_high": ci.high, "n": len(graded)}]
    if set(RETRIEVAL_COUNTS) <= set(graded.columns):
        counts = graded[list(RETRIEVAL_COUNTS)].apply(pd.to_numeric, errors="coerce").dropna()
        if len(counts):
            top = int(pd.to_numeric(graded["retrieval_top"], errors="coerce").max()) \
                if "retrieval_top" in graded.columns else 0
            ci = stats.corpus_micro_f1(counts.to_numpy(dtype=int), n_resamples=n_resamples, seed=seed)
            rows.append({"statistic": f"micro-F1 of the retrieval ranking's top {top if top else 'labels'}",
                         "k": k, "value": ci.estimate, "ci_low": ci.low, "ci_high": ci.high, "n": len(counts)})
    return pd.DataFrame(rows, columns=COLUMNS)


def transfer_screen_table(rows: pd.DataFrame, *, phase: str = SCREEN_PHASE, k: int = SCREEN_K,
                          n_resamples: int = stats.N_BOOTSTRAP, seed: int = 0,
                          readback: pd.DataFrame | None = None,
                          generations: pd.DataFrame | None = None) -> pd.DataFrame:
    """Table 59's rows for one knock-in run of a frozen ranking (``rows``: its ``per_note_sets``,
    columns ``note_id, phase, k, set, necessity, recovery, n_events, n_gated``), :data:`COLUMNS`;
    with ``readback`` (a ``read_side`` run's ``readside_readback_notes`` on the same inputs and
    ranking), the read-back rows of :func:`readback_table` after them; with ``generations`` (the
    ``generate`` run that traced the inputs), the native row of :func:`native_table` last."""
    out: list[dict] = []

    def add(statistic: str, value: float, low: float = math.nan, high: float = math.nan, n: int = 0,
            at: int = k) -> None:
        out.append({"statistic": statistic, "k": at, "value": float(value), "ci_low": float(low),
                    "ci_high": float(high), "n": int(n)})

    if rows.empty:
        return pd.DataFrame(columns=COLUMNS)
    rows = rows.assign(note_id=rows["note_id"].astype(str), k=pd.to_numeric(rows["k"]).astype(int))
    ranked, random = _cell(rows, phase, k, "global"), _cell(rows, phase, k, "random")
    events = pd.to_numeric(ranked.get("n_events", pd.Series(dtype=float)), errors="coerce").fillna(0)
    gated = pd.to_numeric(ranked.get("n_gated", pd.Series(dtype=float)), errors="coerce").fillna(0)
    rec = pd.DataFrame({"ranked": pd.to_numeric(ranked["recovery"], errors="coerce"),
                        "random": pd.to_numeric(random["recovery"], errors="coerce")}).dropna()
    add("inputs with an event of the phase", int((events > 0).sum()))
    add("evaluable inputs (a recovery for both sets)", len(rec))
    add("evaluable events of all events of the phase", float(gated.sum()), n=int(events.sum()))
    for name in ("ranked", "random"):
        if len(rec):
            ci = stats.bootstrap_ci(rec[name].to_numpy(), np.mean, n_resamples=n_resamples, seed=seed)
            add(f"recovery, {name} heads", ci.estimate, ci.low, ci.high, len(rec))
    if len(rec):
        d = stats.paired_difference(rec["ranked"].to_numpy(), rec["random"].to_numpy(), n_resamples=n_resamples,
                                    seed=seed)
        add("recovery, ranked minus random", d.mean_diff, d.ci_low, d.ci_high, d.n)
        add("inputs where ranked minus random is positive", d.n_higher, n=d.n)
    for name, cell in (("ranked", ranked), ("random", random)):
        nec = pd.to_numeric(cell["necessity"], errors="coerce").dropna() if len(cell) else pd.Series(dtype=float)
        if len(nec):
            add(f"necessity, {name} heads", float(nec.mean()), n=len(nec))
    for other in sorted(set(rows["k"]) - {k}):
        cell = pd.to_numeric(_cell(rows, phase, other, "global")["recovery"], errors="coerce").dropna()
        if len(cell):
            add("recovery, ranked heads", float(cell.mean()), n=len(cell), at=other)
    table = pd.DataFrame(out, columns=COLUMNS)
    extra = []
    if readback is not None and not readback.empty:
        extra.append(readback_table(readback, k=k, n_resamples=n_resamples, seed=seed))
    if generations is not None and not generations.empty:
        extra.append(native_table(generations, k=k, n_resamples=n_resamples, seed=seed))
    extra = [t for t in extra if not t.empty]
    return pd.concat([table, *extra], ignore_index=True) if extra else table
