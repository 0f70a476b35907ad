"""Tables 47-51: the precision control and the ablation arms (App. L.3, L.4, M).

Arms are the ``mistill.arm`` of the train run each evaluation or readout measured. The ablation
arms are every arm file of ``projects/configs/arms/`` except the baselines and precision
controls (:data:`NON_ABLATION_ARMS`); each is listed in Tables 50 and 51 whether or not it ran,
a row without runs saying so.

* Table 47 (:func:`precision_table`): task side of the precision control, mean ± sd over seeds,
  and each arm's paired micro-F1 difference from every Vanilla CoT-KD arm's seed-averaged notes.
* Table 48 (:func:`training_ce_table`): the training cross-entropy (``train/ce``) per seed at
  the chosen optimiser steps.
* Table 49 (:func:`own_traces_table`): own-heads knock-in on each arm's own generated traces
  beside the teacher-forced cell on the same notes, and Mistill minus each Vanilla arm on the
  notes both have, per seed pair and note-clustered.
* Table 50 (:func:`ablation_plan_table`): each ablation, what it changes against its base, and
  the direction of its measured effects against Mistill.
* Table 51 (:func:`ablation_table`): each ablation on its own heads: P2C and P2 recovery of the
  own top-40 with random floors, the per-note paired difference against each Mistill seed, the
  difference from the untrained student, M2, the prefix share, and micro-F1 with its paired
  difference from Mistill's seed-averaged notes.
* The carriers of App. M.3 (:func:`pool_carriers_table`): per trained arm, seed and phase, how
  many of the heads its train run supervised are among its own top-40 after training, and how
  many of the untrained student's own top-40 are.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import yaml

from analysis import paired
from analysis.tables import TEACHER_ARM, fmt_ci, fmt_mean_sd
from mistill import stats
from mistill.distill.arms import ARMS_DIR, arm_file, resolve_arm
from mistill.errors import MistillInputError

__all__ = ["MISTILL_ARM", "NON_ABLATION_ARMS", "PRECISION_ARMS", "VANILLA_ARMS", "ablation_arms",
           "ablation_plan_table", "ablation_table", "own_traces_table", "pool_carriers_table",
           "precision_table", "training_ce_table"]

MISTILL_ARM = "mistill"
VANILLA_ARMS: tuple[str, ...] = ("vanilla-fp32", "vanilla-bf16")
PRECISION_ARMS: tuple[str, ...] = ("vanilla-fp32", "vanilla-bf16", "mistill", "mistill-fp32")
"""The precision control of App. L.3 (Tables 47, 48)."""
NON_ABLATION_ARMS: tuple[str, ...] = (*PRECISION_ARMS, "feature-kd", "distillm2", "opd", "gold")
UNTRAINED_ARM = "untrained"
OWN_K = 40
"""The own top-k of Tables 49 and 51 (the paper's operating point)."""


def ablation_arms() -> list[str]:
    """Every arm file's name that is not a baseline or precision control, sorted."""
    return sorted(p.stem for p in ARMS_DIR.glob("*.yaml") if p.stem not in NON_ABLATION_ARMS)


def absent_reason(arm: str, train: pd.DataFrame, what: str) -> str:
    """Why an arm has no row: no train runs at all, or trained but lacking ``what``."""
    if train.empty or not (train["arm"] == arm).any():
        return f"no train runs of arm {arm} under this experiment"
    return f"no {what} of arm {arm}"


def _runs_of(frame: pd.DataFrame, arm: str) -> pd.DataFrame:
    return frame[frame["arm"] == arm] if not frame.empty else frame


def _notes_of(per_note: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame:
    if per_note.empty or runs.empty:
        return per_note.iloc[0:0]
    return per_note[per_note["run_id"].isin(runs["run_id"])]


def _mean_sd(values: Sequence[float]) -> tuple[float, float]:
    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], dtype=float)
    return (float(v.mean()) if v.size else math.nan,
            float(v.std(ddof=1)) if v.size > 1 else math.nan)


# ---------------------------------------------------------------------------------- Table 47
def precision_table(evaluate: pd.DataFrame, per_note: pd.DataFrame, train: pd.DataFrame, *,
                    n_resamples: int = stats.N_BOOTSTRAP, seed: int = 0) -> pd.DataFrame:
    """Table 47: per arm of :data:`PRECISION_ARMS` (and model), micro-F1, valid and cap rate
    mean and sd over seeds, and ``Δ vs <vanilla arm>``: the paired per-note micro-F1 difference
    from that arm's seed-averaged notes (seed-averaged per note on both sides) with its
    bootstrap interval. An arm without evaluations is one row with ``note``."""
    rows = []
    models = sorted(evaluate["model"].dropna().unique()) if not evaluate.empty else []
    for arm in PRECISION_ARMS:
        mine = _runs_of(evaluate, arm)
        if mine.empty:
            rows.append({"arm": arm, "note": absent_reason(arm, train, "test evaluate runs")})
            continue
        for model in models:
            grp = mine[mine["model"] == model]
            if grp.empty:
                continue
            rec: dict[str, Any] = {"model": model, "arm": arm, "n_seeds": len(grp)}
            for m in ("micro_f1", "valid_rate", "cap_rate"):
                rec[f"{m}.mean"], rec[f"{m}.sd"] = _mean_sd(grp[m]) if m in grp else (
                    math.nan, math.nan)
            notes = []
            for ref_arm in VANILLA_ARMS:
                ref = evaluate[(evaluate["arm"] == ref_arm) & (evaluate["model"] == model)]
                if ref_arm == arm:
                    continue
                if ref.empty:
                    notes.append(f"no evaluate runs of {ref_arm}")
                    continue
                try:
                    res = paired.seed_averaged(_notes_of(per_note, grp), _notes_of(per_note, ref),
                                               "micro_f1", n_resamples=n_resamples, seed=seed)
                except MistillInputError as exc:
                    notes.append(f"vs {ref_arm}: {exc}")
                    continue
                rec.update({f"vs {ref_arm}.mean_diff": res.mean_diff,
                            f"vs {ref_arm}.ci_low": res.ci_low,
                            f"vs {ref_arm}.ci_high": res.ci_high})
            rows.append({**rec, "note": "; ".join(notes)})
    cols = ["model", "arm", "n_seeds", "micro_f1.mean", "micro_f1.sd", "valid_rate.mean",
            "valid_rate.sd", "cap_rate.mean", "cap_rate.sd"]
    cols += [f"vs {r}.{k}" for r in VANILLA_ARMS for k in ("mean_diff", "ci_low", "ci_high")]
    return pd.DataFrame.from_records(rows, columns=[*cols, "note"])


def precision_display(table: pd.DataFrame) -> pd.DataFrame:
    out = []
    for _, r in table.iterrows():
        n = int(r["n_seeds"]) if pd.notna(r["n_seeds"]) else 0
        rec = {"model": r["model"] if isinstance(r["model"], str) else "", "arm": r["arm"],
               "seeds": n or ""}
        for m, label in (("micro_f1", "micro-F1"), ("valid_rate", "valid"), ("cap_rate", "cap")):
            rec[label] = fmt_mean_sd(r[f"{m}.mean"], r[f"{m}.sd"], n) if n else ""
        for ref in VANILLA_ARMS:
            rec[f"Δ vs {ref} [95% CI]"] = fmt_ci(r[f"vs {ref}.mean_diff"], r[f"vs {ref}.ci_low"],
                                                 r[f"vs {ref}.ci_high"])
        rec["note"] = r["note"] if isinstance(r["note"], str) else ""
        out.append(rec)
    return pd.DataFrame.from_records(out)


# ---------------------------------------------------------------------------------- Table 48
def training_ce_table(train: pd.DataFrame, history: Mapping[str, Mapping[int, float]],
                      steps: Sequence[int]) -> pd.DataFrame:
    """Table 48: per train run of :data:`PRECISION_ARMS`, ``train/ce`` at each of ``steps``
    (NaN where the run logged no value at that step) and at its last logged step.
    ``history``: train run id -> ``{step: ce}``. An arm without train runs is one row with
    ``note``."""
    rows = []
    for arm in PRECISION_ARMS:
        runs = _runs_of(train, arm)
        if runs.empty:
            rows.append({"arm": arm, "note": f"no train runs of arm {arm} under this experiment"})
            continue
        for _, run in runs.sort_values("seed", kind="stable").iterrows():
            h = history.get(run["run_id"], {})
            rec: dict[str, Any] = {"model": run["model"], "arm": arm,
                                   "precision": run["precision"], "seed": run["seed"]}
            for s in steps:
                rec[f"step {s}"] = h.get(int(s), math.nan)
            last = max(h) if h else None
            rec["last_step"] = last if last is not None else math.nan
            rec["last"] = h[last] if last is not None else math.nan
            rows.append({**rec, "note": "" if h else "the run logged no train/ce"})
    return pd.DataFrame.from_records(rows, columns=[
        "model", "arm", "precision", "seed", *(f"step {s}" for s in steps), "last_step", "last",
        "note"])


# ---------------------------------------------------------------------------------- Table 49
def _traces(per_note: pd.DataFrame, traces: str) -> pd.DataFrame:
    """Rows of own-heads per-note tables read on ``traces`` (a table without the ``traces``
    column holds teacher-forced rows only)."""
    if per_note.empty:
        return per_note
    if "traces" not in per_note.columns:
        return per_note if traces == "teacher" else per_note.iloc[0:0]
    return per_note[per_note["traces"] == traces]


def own_traces_table(own: pd.DataFrame, own_notes: pd.DataFrame, train: pd.DataFrame,
                     arms: Sequence[str], *, phase: str = "P2C", ks: Sequence[int] = (8, OWN_K),
                     n_resamples: int = stats.N_BOOTSTRAP, seed: int = 0
                     ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Table 49: ``(rows, paired)``.

    rows: per own-heads run of ``arms`` (and the untrained student), ``coverage`` (notes with a
    measurable own-trace recovery) and per k of ``ks`` at ``phase`` the mean over notes of the
    own-trace ``recovery_own`` (random floor beside it) and of the teacher-forced one on the
    same notes; an arm without own-trace rows is one row with ``note``.
    paired: Mistill minus each Vanilla arm on own-trace recovery per k, per seed pair and
    note-clustered (:func:`analysis.paired.seed_matched`, notes both have events for).
    """
    own_rows, teacher_rows = _traces(own_notes, "own"), _traces(own_notes, "teacher")
    rows = []
    for arm in (UNTRAINED_ARM, *arms):
        runs = _runs_of(own, arm)
        mine = _notes_of(own_rows, runs)
        if mine.empty or mine["recovery_own"].isna().all():
            if arm != UNTRAINED_ARM or not runs.empty:
                rows.append({"arm": arm, "note": absent_reason(arm, train, "own-trace readouts")
                             if arm != UNTRAINED_ARM else "no own-trace readouts of the "
                                                         "untrained student"})
            continue
        for _, run in runs.iterrows():
            o = own_rows[own_rows["run_id"] == run["run_id"]]
            t = teacher_rows[teacher_rows["run_id"] == run["run_id"]]
            rec: dict[str, Any] = {"model": run["model"], "arm": arm, "seed": run["seed"],
                                   "coverage": int(o.loc[o["phase"] == phase].dropna(
                                       subset=["recovery_own"])["note_id"].nunique())}
            for k in ks:
                oc = o[(o["phase"] == phase) & (o["k"] == k)].dropna(subset=["recovery_own"])
                tc = t[(t["phase"] == phase) & (t["k"] == k)
                       & t["note_id"].isin(oc["note_id"])]
                rec[f"k{k}.own"] = float(oc["recovery_own"].mean()) if len(oc) else math.nan
                rec[f"k{k}.own_random"] = float(oc["recovery_random"].mean()) if len(oc) \
                    else math.nan
                rec[f"k{k}.teacher"] = float(tc["recovery_own"].mean()) if len(tc) else math.nan
            rows.append({**rec, "note": ""})
    cols = ["model", "arm", "seed", "coverage"]
    cols += [f"k{k}.{s}" for k in ks for s in ("own", "own_random", "teacher")]
    table = pd.DataFrame.from_records(rows, columns=[*cols, "note"])
    pairs = []
    for ref_arm in VANILLA_ARMS:
        a = _notes_of(own_rows, _runs_of(own, MISTILL_ARM))
        r = _notes_of(own_rows, _runs_of(own, ref_arm))
        if a.empty or r.empty:
            continue
        for k in ks:
            ac = a[(a["phase"] == phase) & (a["k"] == k)].dropna(subset=["recovery_own"])
            rc = r[(r["phase"] == phase) & (r["k"] == k)].dropna(subset=["recovery_own"])
            try:
                res = paired.seed_matched(ac, rc, "recovery_own", n_resamples=n_resamples,
                                          seed=seed)
            except MistillInputError:
                continue
            for pair, pr in res.per_pair.items():
                pairs.append({"comparison": f"{MISTILL_ARM} - {ref_arm}", "k": k,
                              "seeds": f"{pair[0]} vs {pair[1]}",
                              **paired.difference_row(pr)})
            pairs.append({"comparison": f"{MISTILL_ARM} - {ref_arm}", "k": k,
                          "seeds": "note-clustered", **paired.clustered_row(res)})
    return table, pd.DataFrame.from_records(pairs)


def own_traces_display(table: pd.DataFrame) -> pd.DataFrame:
    out = []
    ks = [c[1:-len(".own")] for c in table.columns if c.startswith("k") and c.endswith(".own")]
    for _, r in table.iterrows():
        rec = {"model": r["model"] if isinstance(r["model"], str) else "", "arm": r["arm"],
               "seed": "" if pd.isna(r["seed"]) else int(r["seed"]),
               "coverage": "" if pd.isna(r["coverage"]) else int(r["coverage"])}
        for k in ks:
            own, floor, tf = r[f"k{k}.own"], r[f"k{k}.own_random"], r[f"k{k}.teacher"]
            rec[f"own k{k}"] = (f"{own:.3f} ({floor:.3f})" if pd.notna(own) and pd.notna(floor)
                                else "" if pd.isna(own) else f"{own:.3f}")
            rec[f"teacher-forced k{k}"] = "" if pd.isna(tf) else f"{tf:.3f}"
        rec["note"] = r["note"] if isinstance(r["note"], str) else ""
        out.append(rec)
    return pd.DataFrame.from_records(out)


# ---------------------------------------------------------------------------------- Table 51
def _cell(frame: pd.DataFrame, phase: str, k: int) -> pd.DataFrame:
    return frame[(frame["phase"] == phase) & (frame["k"] == k)]


def _median_over_seeds(runs: pd.DataFrame, metric: str) -> float:
    vals = runs[metric].dropna() if metric in runs.columns else []
    return float(np.mean(vals)) if len(vals) else math.nan


def ablation_table(own: pd.DataFrame, own_notes: pd.DataFrame, evaluate: pd.DataFrame,
                   eval_notes: pd.DataFrame, train: pd.DataFrame, arms: Sequence[str], *,
                   n_resamples: int = stats.N_BOOTSTRAP, seed: int = 0) -> pd.DataFrame:
    """Table 51: one row per ablation arm in ``arms`` (per model it ran on).

    ``P2C``/``P2``: the own top-40 recovery (``m4/<phase>/k40/recovery_own``, median over
    notes, mean over the arm's seeds) with its random floor; ``vs mistill seed <s>``: the
    per-note paired median difference of P2C recovery (the arm's notes seed-averaged) against
    Mistill seed ``s`` and its sign-test p; ``vs base``: notes higher / lower than the untrained
    student; ``m2``, ``m2_random``: P2C region lift of the own and random heads; ``prefix``:
    the prefix share; ``micro_f1`` and its paired difference from Mistill's seed-averaged
    notes [95% CI]. An arm without runs is one row with ``note``."""
    teacher = _traces(own_notes, "teacher")
    rows = []
    for arm in arms:
        runs = _runs_of(own, arm)
        evals = _runs_of(evaluate, arm)
        if runs.empty and evals.empty:
            rows.append({"arm": arm, "note": absent_reason(arm, train,
                                                           "own_heads or evaluate runs")})
            continue
        models = sorted(set(runs["model"].dropna()) | set(evals["model"].dropna()))
        for model in models:
            r_m, e_m = runs[runs["model"] == model], evals[evals["model"] == model]
            rec: dict[str, Any] = {"model": model, "arm": arm,
                                   "n_seeds": int(max(len(r_m), len(e_m)))}
            notes: list[str] = []
            for phase in ("P2C", "P2"):
                rec[f"{phase}.own"] = _median_over_seeds(r_m, f"m4/{phase}/k{OWN_K}/recovery_own")
                rec[f"{phase}.random"] = _median_over_seeds(
                    r_m, f"m4/{phase}/k{OWN_K}/recovery_random")
            rec["m2"] = _median_over_seeds(r_m, "m2/P2C/region_lift")
            rec["m2_random"] = _median_over_seeds(r_m, "m2/P2C/region_lift_random")
            rec["prefix"] = _median_over_seeds(r_m, "prefix_share")
            mine = _cell(_notes_of(teacher, r_m), "P2C", OWN_K)
            if r_m.empty:
                notes.append(f"no own_heads runs of arm {arm}")
            else:
                rec.update(_vs_mistill_seeds(mine, own, teacher, model, n_resamples, seed, notes))
                base = _cell(_notes_of(teacher, own[(own["arm"] == UNTRAINED_ARM)
                                                    & (own["model"] == model)]), "P2C", OWN_K)
                if base.empty:
                    notes.append("no own_heads run of the untrained student")
                else:
                    try:
                        res = paired.seed_averaged(mine, base, "recovery_own",
                                                   n_resamples=n_resamples, seed=seed)
                        rec.update(base_higher=res.n_higher, base_lower=res.n_lower)
                    except MistillInputError as exc:
                        notes.append(f"vs base: {exc}")
            rec["micro_f1"] = _median_over_seeds(e_m, "micro_f1")
            ref = evaluate[(evaluate["arm"] == MISTILL_ARM) & (evaluate["model"] == model)] \
                if not evaluate.empty else evaluate
            if e_m.empty:
                notes.append(f"no test evaluate runs of arm {arm}")
            elif ref.empty:
                notes.append("no test evaluate runs of mistill")
            else:
                try:
                    res = paired.seed_averaged(_notes_of(eval_notes, e_m),
                                               _notes_of(eval_notes, ref), "micro_f1",
                                               n_resamples=n_resamples, seed=seed)
                    rec.update({"f1.mean_diff": res.mean_diff, "f1.ci_low": res.ci_low,
                                "f1.ci_high": res.ci_high})
                except MistillInputError as exc:
                    notes.append(f"micro-F1: {exc}")
            rows.append({**rec, "note": "; ".join(notes)})
    return pd.DataFrame.from_records(rows)


def _vs_mistill_seeds(mine: pd.DataFrame, own: pd.DataFrame, teacher: pd.DataFrame, model: str,
                      n_resamples: int, seed: int, notes: list[str]) -> dict[str, Any]:
    ref_runs = own[(own["arm"] == MISTILL_ARM) & (own["model"] == model)]
    if ref_runs.empty:
        notes.append("no own_heads runs of mistill")
        return {}
    out: dict[str, Any] = {}
    for _, run in ref_runs.sort_values("seed", kind="stable").iterrows():
        ref = _cell(teacher[teacher["run_id"] == run["run_id"]], "P2C", OWN_K)
        try:
            res = paired.seed_averaged(mine, ref, "recovery_own", n_resamples=n_resamples,
                                       seed=seed)
        except MistillInputError as exc:
            notes.append(f"vs mistill seed {run['seed']}: {exc}")
            continue
        out[f"vs mistill seed {run['seed']}.median_diff"] = res.median_diff
        out[f"vs mistill seed {run['seed']}.sign_p"] = res.sign_p
    return out


def ablation_display(table: pd.DataFrame) -> pd.DataFrame:
    out = []
    seeds = sorted({c.split(".")[0] for c in table.columns if c.startswith("vs mistill seed")})
    for _, r in table.iterrows():
        get = r.get
        n = get("n_seeds")
        rec = {"model": get("model") if isinstance(get("model"), str) else "",
               "arm": r["arm"] + (f" [{int(n)} seeds]" if pd.notna(n) and int(n) > 1 else "")}
        for phase in ("P2C", "P2"):
            own, floor = get(f"{phase}.own"), get(f"{phase}.random")
            rec[phase] = (f"{own:.3f} ({floor:.3f})" if pd.notna(own) and pd.notna(floor)
                          else "" if own is None or pd.isna(own) else f"{own:.3f}")
        rec["Δ P2C vs mistill seeds (sign p)"] = " / ".join(
            f"{get(s + '.median_diff'):+.3f} ({get(s + '.sign_p'):.2g})" for s in seeds
            if pd.notna(get(s + ".median_diff")))
        hi, lo = get("base_higher"), get("base_lower")
        rec["vs base"] = f"{int(hi)}/{int(lo)}" if hi is not None and pd.notna(hi) else ""
        m2, m2r = get("m2"), get("m2_random")
        rec["M2"] = (f"{m2:.3f} ({m2r:.3f})" if m2 is not None and pd.notna(m2)
                     and pd.notna(m2r) else "")
        pre = get("prefix")
        rec["prefix"] = f"{pre:.3f}" if pre is not None and pd.notna(pre) else ""
        f1 = get("micro_f1")
        diff = fmt_ci(get("f1.mean_diff", math.nan), get("f1.ci_low", math.nan),
                      get("f1.ci_high", math.nan)) if "f1.mean_diff" in table.columns else ""
        rec["micro-F1 (Δ vs mistill)"] = ((f"{f1:.3f}" if f1 is not None and pd.notna(f1)
                                           else "") + (f" ({diff})" if diff else ""))
        rec["note"] = r["note"] if isinstance(r["note"], str) else ""
        out.append(rec)
    return pd.DataFrame.from_records(out)


# ---------------------------------------------------------------------------------- Table 50
def arm_change(arm: str) -> tuple[str, str]:
    """``(base, flags)``: the arm file's base and the flags whose resolved value differs from the
    base's (``flag: base -> arm``)."""
    try:
        base = str(_base_of(arm) or "")
        mine, theirs = resolve_arm(arm), resolve_arm(base) if base else None
    except MistillInputError as exc:
        return "", str(exc)
    if theirs is None:
        return "", ""
    changed = [f"{f.name}: {getattr(theirs, f.name)} -> {getattr(mine, f.name)}"
               for f in dataclasses.fields(mine) if getattr(mine, f.name) != getattr(theirs, f.name)]
    return base, "; ".join(changed)


def _base_of(arm: str) -> str | None:
    doc = yaml.safe_load(arm_file(arm).read_text()) or {}
    return doc.get("base")


def ablation_plan_table(arms: Sequence[str], ablations: pd.DataFrame, *, alpha: float = 0.05
                        ) -> pd.DataFrame:
    """Table 50: per ablation arm, its base, the flags it changes, the description of its arm
    file, and the direction of its measured P2C and micro-F1 differences from Mistill (from
    :func:`ablation_table`: ``higher`` / ``lower`` / ``level`` when every Mistill seed's sign
    test or the micro-F1 interval agrees, ``mixed`` otherwise, empty without a measurement).

    **[recon]** The paper's Table 50 also prints each pre-registered expectation with a ✓ or ✗;
    the arm files do not record the expectations, so the outcome column gives the direction
    only, at the sign-test level ``alpha`` = 0.05 (App. L.7's reading rule)."""
    rows = []
    for arm in arms:
        base, flags = arm_change(arm)
        doc = yaml.safe_load(arm_file(arm).read_text()) or {}
        mine = ablations[ablations["arm"] == arm] if not ablations.empty else ablations
        rec = {"arm": arm, "base": base, "changes": flags,
               "description": str(doc.get("description", "")),
               "P2C vs mistill": _direction_p2c(mine, alpha), "micro-F1 vs mistill": _direction_f1(mine),
               "note": "; ".join(n for n in mine.get("note", pd.Series(dtype=str)).dropna()
                                 if n) if len(mine) else ""}
        rows.append(rec)
    return pd.DataFrame.from_records(rows)


def _direction_p2c(rows: pd.DataFrame, alpha: float) -> str:
    dirs = set()
    for _, r in rows.iterrows():
        for c in r.index:
            if c.startswith("vs mistill seed") and c.endswith(".median_diff") and pd.notna(r[c]):
                p = r[c.replace(".median_diff", ".sign_p")]
                dirs.add("level" if not p < alpha else "higher" if r[c] > 0 else "lower")
    return "" if not dirs else dirs.pop() if len(dirs) == 1 else "mixed"


def _direction_f1(rows: pd.DataFrame) -> str:
    dirs = set()
    for _, r in rows.iterrows():
        lo, hi = r.get("f1.ci_low"), r.get("f1.ci_high")
        if lo is None or hi is None or pd.isna(lo) or pd.isna(hi):
            continue
        dirs.add("higher" if lo > 0 else "lower" if hi < 0 else "level")
    return "" if not dirs else dirs.pop() if len(dirs) == 1 else "mixed"


# ------------------------------------------------------------------------ App. M.3 carriers
CARRIER_PHASES: tuple[str, ...] = ("P1", "P2", "P2C")
CARRIER_COLUMNS: tuple[str, ...] = (
    "model", "arm", "precision", "seed", "phase", "pool_size", "own_top_k", "pool_carriers",
    "pool_carrier_share", "base_top_k", "base_carriers", "base_carrier_share", "rank_notes",
    "rank_events", "own_heads_run", "train_run", "note")


def _top(sets: Mapping[str, Any] | None, phase: str, k: int) -> list[str] | None:
    """The first ``k`` heads of an own-heads run's ranking at ``phase`` (``own_heads_sets.json``:
    phase -> head names, best first), or None when the run lists none there."""
    heads = sets.get(phase) if isinstance(sets, Mapping) else None
    return [str(h) for h in heads[:k]] if isinstance(heads, list) and heads else None


def _pool_heads(pools: Mapping[str, Any] | None, phase: str) -> list[str] | None:
    """The head names of a train run's supervised pool at ``phase`` (``student_pools.json``:
    phase -> :meth:`mistill.distill.pools.Pool.to_dict`), or None without one."""
    pool = pools.get(phase) if isinstance(pools, Mapping) else None
    names = pool.get("head_names") if isinstance(pool, Mapping) else None
    return [str(h) for h in names] if isinstance(names, list) else None


def _count(value: Any) -> float:
    return float(value) if value is not None and pd.notna(value) else math.nan


def pool_carriers_table(own: pd.DataFrame, pools: Mapping[str, Any], own_sets: Mapping[str, Any],
                        rank_counts: Mapping[str, Mapping[str, float]] | None = None, *,
                        k: int = OWN_K, phases: Sequence[str] = CARRIER_PHASES) -> pd.DataFrame:
    """App. M.3's carriers: per own-heads run of a trained arm (``own``: one row per run with
    ``run_id``, ``model``, ``arm``, ``precision``, ``seed``, ``train_run``) and per phase:

    * ``pool_size``: the heads the arm's train run supervised at that phase (its
      ``student_pools.json``, ``pools``: train run id -> document; NaN for an arm without an
      attention term, whose train run logs no pools);
    * ``own_top_k``: the heads of the trained student's own top-``k`` (its own-heads run's
      ``own_heads_sets.json``, ``own_sets``: own-heads run id -> document; fewer than ``k`` when
      the run ranked fewer);
    * ``pool_carriers``: how many supervised heads are among them, and ``pool_carrier_share``
      that count over ``pool_size``;
    * ``base_top_k``, ``base_carriers``, ``base_carrier_share``: the same against the untrained
      student's own top-``k`` (the own-heads run of arm ``untrained`` on the same model), the
      share over ``own_top_k``;
    * ``rank_notes``, ``rank_events``: the notes and events the trained student's own ranking
      rests on at that phase (``rank_counts``: own-heads run id -> ``{"<phase>/notes": n,
      "<phase>/events": n}``; NaN where not logged).

    A run without a readable own ranking is one row with ``note``. The untrained student's and
    the teacher's own-heads runs give no rows of their own."""
    counts = rank_counts or {}
    rows: list[dict[str, Any]] = []
    if own.empty:
        return pd.DataFrame(columns=list(CARRIER_COLUMNS))
    base_runs = own[own["arm"] == UNTRAINED_ARM]
    trained = own[~own["arm"].isin([UNTRAINED_ARM, TEACHER_ARM])]
    for _, run in trained.sort_values(["model", "arm", "seed"], kind="stable").iterrows():
        train_run = run.get("train_run")
        train_run = str(train_run) if isinstance(train_run, str) and train_run else None
        rec: dict[str, Any] = {"model": run["model"], "arm": run["arm"],
                               "precision": run.get("precision"), "seed": run.get("seed"),
                               "own_heads_run": run["run_id"], "train_run": train_run}
        sets = own_sets.get(run["run_id"])
        if not isinstance(sets, Mapping):
            rows.append({**rec, "note": "the own-heads run logged no own_heads_sets.json"})
            continue
        doc = pools.get(train_run) if train_run else None
        base = base_runs[base_runs["model"] == run["model"]]
        base_sets = own_sets.get(base["run_id"].iloc[0]) if len(base) else None
        for phase in phases:
            mine = _top(sets, phase, k)
            notes: list[str] = []
            out = {**rec, "phase": phase}
            if mine is None:
                rows.append({**out, "note": f"the own ranking has no {phase} heads"})
                continue
            out["own_top_k"] = len(mine)
            if len(mine) < k:
                notes.append(f"the own ranking lists {len(mine)} heads, fewer than {k}")
            pool = _pool_heads(doc, phase)
            if pool is not None:
                hits = len(set(pool) & set(mine))
                out.update(pool_size=len(pool), pool_carriers=hits,
                           pool_carrier_share=hits / len(pool) if pool else math.nan)
            elif not train_run:
                notes.append("no train run named")
            elif doc is None:
                notes.append("the train run logged no supervised pools")
            else:
                notes.append(f"the train run supervised no {phase} pool")
            theirs = _top(base_sets, phase, k)
            if theirs is not None:
                hits = len(set(theirs) & set(mine))
                out.update(base_top_k=len(theirs), base_carriers=hits,
                           base_carrier_share=hits / len(mine))
            else:
                notes.append("no own ranking of the untrained student" if base.empty else
                             f"the untrained student's own ranking has no {phase} heads")
            got = counts.get(run["run_id"], {})
            out["rank_notes"] = _count(got.get(f"{phase}/notes"))
            out["rank_events"] = _count(got.get(f"{phase}/events"))
            rows.append({**out, "note": "; ".join(notes)})
    table = pd.DataFrame.from_records(rows, columns=list(CARRIER_COLUMNS))
    for col in ("pool_size", "own_top_k", "pool_carriers", "base_top_k", "base_carriers"):
        table[col] = pd.to_numeric(table[col], errors="coerce").astype("Int64")
    return table


def pool_carriers_display(table: pd.DataFrame) -> pd.DataFrame:
    """The carriers table as printed: ``carriers of pool (share)`` per comparison."""
    def of(hits: Any, total: Any, share: Any) -> str:
        if hits is None or pd.isna(hits):
            return ""
        return f"{int(hits)} of {int(total)} ({share:.3f})"

    def num(v: Any) -> str:
        return "" if v is None or pd.isna(v) else str(int(v))

    out = []
    for _, r in table.iterrows():
        out.append({"model": r["model"] if isinstance(r["model"], str) else "", "arm": r["arm"],
                    "seed": num(r["seed"]), "phase": r["phase"] if isinstance(r["phase"], str) else "",
                    "supervised heads in own top-k": of(r["pool_carriers"], r["pool_size"],
                                                        r["pool_carrier_share"]),
                    "untrained top-k in own top-k": of(r["base_carriers"], r["own_top_k"],
                                                       r["base_carrier_share"]),
                    "own top-k": num(r["own_top_k"]),
                    "ranking notes / events": (f"{num(r['rank_notes'])} / {num(r['rank_events'])}"
                                               if pd.notna(r["rank_notes"]) or pd.notna(r["rank_events"])
                                               else ""),
                    "note": r["note"] if isinstance(r["note"], str) else ""})
    return pd.DataFrame.from_records(out)
