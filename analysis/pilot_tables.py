"""The programming pilot's comparison (App. P, Table 60) from its ``own_heads`` and ``evaluate`` runs.

* :func:`recovery_table`: paired differences in own-heads P2C recovery between two arms, seed i
  against seed i, on the common support (the inputs evaluable in both arms at every seed the two
  share); per input the seed-averaged difference; the seed-averaged median over inputs, the mean
  with a percentile bootstrap resampling near-duplicate groups (each input carrying all its
  seeds), the inputs above zero and each seed pair's median. At the primary k = 40 and the
  sensitivity k = 29, for Mistill against Vanilla CoT-KD, Mistill against RandHeads and RandHeads
  against Vanilla CoT-KD; the raw knock-in gain in nats (``gain_own_nats``) for Mistill against
  Vanilla CoT-KD at k = 40.
* :func:`pass_table`: pass@1 per arm and seed on the development tasks (``evaluate`` runs'
  per-task ``passed``) with the count of tasks holding a terminal sandbox verdict, and the paired
  pass-rate changes (per seed the mean change, seed-averaged per task, the mean with a bootstrap
  over task groups).
* :func:`pilot_verdict`: the author's advancement thresholds (:data:`THRESHOLDS`), fixed before the
  pilot's outcome: "meaningful" (a seed-averaged median gain in own-heads P2C recovery at k = 40 of
  at least +0.030 over Vanilla CoT-KD and +0.015 over RandHeads, both seed pairs positive for both)
  and "acceptable" (a seed-averaged pass@1 change of at least -0.030 against Vanilla CoT-KD, with a
  terminal sandbox result for every task). They are thresholds for advancing to a confirmation,
  not efficacy criteria.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd

from mistill import stats

__all__ = ["PILOT_PHASE", "PRIMARY_K", "SENSITIVITY_K", "THRESHOLDS", "CONTRASTS", "RECOVERY_COLUMNS",
           "PASS_COLUMNS", "ARM_PASS_COLUMNS", "seed_differences", "recovery_table", "pass_table", "arm_pass_table",
           "pilot_verdict"]

PILOT_PHASE = "P2C"
"""The pilot's readout phase: the contrastive first-mention event."""
PRIMARY_K = 40
SENSITIVITY_K = 29
"""The primary own-heads budget and its prespecified sensitivity (App. P)."""
THRESHOLDS: Mapping[str, float] = {"recovery_vs_vanilla": 0.030, "recovery_vs_randheads": 0.015,
                                   "pass_at_1_vs_vanilla": -0.030}
"""The author's advancement thresholds (module docstring)."""
CONTRASTS: tuple[tuple[str, str], ...] = (("mistill", "vanilla-bf16"), ("mistill", "randheads"),
                                          ("randheads", "vanilla-bf16"))
"""(arm, reference) of the pilot's three contrasts."""

RECOVERY_COLUMNS: tuple[str, ...] = ("readout", "k", "arm", "reference", "median", "mean", "ci_low", "ci_high",
                                     "n_inputs", "n_groups", "n_above_zero", "seed_pairs", "threshold", "met")
PASS_COLUMNS: tuple[str, ...] = ("arm", "reference", "mean", "ci_low", "ci_high", "n_tasks", "n_groups",
                                 "seed_pairs", "threshold", "met")
ARM_PASS_COLUMNS: tuple[str, ...] = ("arm", "seed", "pass_at_1", "n_tasks", "n_terminal", "complete")


def seed_differences(rows: pd.DataFrame, arm: str, reference: str, value: str) -> pd.DataFrame:
    """Per input (rows) and seed (columns), ``arm`` minus ``reference`` on ``value``, seed i against
    seed i, kept where the input has a finite value in both arms at every seed both have: the
    common support. ``rows`` holds ``arm, seed, note_id`` and ``value``; empty when the two arms
    share no seed."""
    def wide(name: str) -> pd.DataFrame:
        sub = rows[rows["arm"] == name]
        if sub.empty:
            return pd.DataFrame()
        return sub.pivot_table(index="note_id", columns="seed", values=value, aggfunc="mean")

    a, r = wide(arm), wide(reference)
    seeds = sorted(set(a.columns) & set(r.columns)) if not (a.empty or r.empty) else []
    if not seeds:
        return pd.DataFrame()
    return (a[seeds] - r[seeds]).dropna()


def _threshold(arm: str, reference: str, k: int, readout: str) -> tuple[str, float | None]:
    if readout != "recovery" or k != PRIMARY_K:
        return "", None
    if (arm, reference) == ("mistill", "vanilla-bf16"):
        return "recovery_vs_vanilla", THRESHOLDS["recovery_vs_vanilla"]
    if (arm, reference) == ("mistill", "randheads"):
        return "recovery_vs_randheads", THRESHOLDS["recovery_vs_randheads"]
    return "", None


def _row(readout: str, k: int, arm: str, reference: str, diffs: pd.DataFrame, groups: Mapping[str, str],
         n_resamples: int, seed: int) -> dict:
    per_input = diffs.mean(axis=1)
    ci = stats.group_bootstrap_mean(per_input.to_dict(), groups, n_resamples=n_resamples, seed=seed)
    key, bound = _threshold(arm, reference, k, readout)
    pairs = {s: float(np.median(diffs[s])) for s in diffs.columns}
    met = None
    if bound is not None:
        met = bool(float(np.median(per_input)) >= bound and len(pairs) >= 2 and all(v > 0 for v in pairs.values()))
    return {"readout": readout, "k": k, "arm": arm, "reference": reference, "median": float(np.median(per_input)),
            "mean": ci.estimate, "ci_low": ci.low, "ci_high": ci.high, "n_inputs": len(per_input),
            "n_groups": len({groups[q] for q in per_input.index}), "n_above_zero": int((per_input > 0).sum()),
            "seed_pairs": ", ".join(f"{s}: {v:+.4f}" for s, v in pairs.items()),
            "threshold": f"median >= {bound:+.3f}, every seed pair > 0" if bound is not None else "", "met": met}


def recovery_table(own: pd.DataFrame, groups: Mapping[str, str], *, n_resamples: int = stats.N_BOOTSTRAP,
                   seed: int = 0) -> pd.DataFrame:
    """Table 60's recovery panel (module docstring). ``own``: ``own_heads`` per-note rows with
    ``arm, seed, note_id, phase, k, recovery_own, gain_own_nats``; ``groups``: input -> its
    near-duplicate group. A contrast without a seed pair or common support is left out."""
    out = []
    if own.empty:
        return pd.DataFrame(columns=list(RECOVERY_COLUMNS))
    sel = own[own["phase"] == PILOT_PHASE]
    readouts = [("recovery", PRIMARY_K, "recovery_own", CONTRASTS),
                ("recovery", SENSITIVITY_K, "recovery_own", CONTRASTS),
                ("raw gain (nats)", PRIMARY_K, "gain_own_nats", CONTRASTS[:1])]
    for readout, k, value, contrasts in readouts:
        at_k = sel[sel["k"].astype(int) == k]
        if at_k.empty or value not in at_k:
            continue
        for arm, reference in contrasts:
            diffs = seed_differences(at_k, arm, reference, value)
            if not diffs.empty:
                out.append(_row(readout, k, arm, reference, diffs, groups, n_resamples, seed))
    return pd.DataFrame(out, columns=list(RECOVERY_COLUMNS))


def arm_pass_table(answers: pd.DataFrame, tasks: int | None = None) -> pd.DataFrame:
    """pass@1 per arm and seed (``answers``: ``evaluate`` per-task rows with ``arm, seed, note_id,
    passed`` and ``verdict``), the tasks read and those with a terminal verdict; ``complete`` when
    every one of ``tasks`` (default: the tasks read) has one."""
    rows = []
    for (arm, s), grp in answers.groupby(["arm", "seed"], sort=True):
        per_task = grp.groupby("note_id").first()
        terminal = int(per_task["verdict"].notna().sum()) if "verdict" in per_task else 0
        n = int(len(per_task))
        rows.append({"arm": arm, "seed": s, "pass_at_1": float(per_task["passed"].fillna(0).mean()), "n_tasks": n,
                     "n_terminal": terminal, "complete": bool(terminal == (tasks if tasks is not None else n))})
    return pd.DataFrame(rows, columns=list(ARM_PASS_COLUMNS))


def pass_table(answers: pd.DataFrame, groups: Mapping[str, str], *, n_resamples: int = stats.N_BOOTSTRAP,
               seed: int = 0) -> pd.DataFrame:
    """Table 60's pass@1 panel: each contrast's paired pass-rate change (module docstring); the
    seed columns are the mean changes of each seed pair."""
    out = []
    if answers.empty:
        return pd.DataFrame(columns=list(PASS_COLUMNS))
    values = answers.assign(passed=answers["passed"].astype(float))
    for arm, reference in CONTRASTS:
        diffs = seed_differences(values, arm, reference, "passed")
        if diffs.empty:
            continue
        per_task = diffs.mean(axis=1)
        ci = stats.group_bootstrap_mean(per_task.to_dict(), groups, n_resamples=n_resamples, seed=seed)
        locked = (arm, reference) == ("mistill", "vanilla-bf16")
        bound = THRESHOLDS["pass_at_1_vs_vanilla"]
        out.append({"arm": arm, "reference": reference, "mean": ci.estimate, "ci_low": ci.low, "ci_high": ci.high,
                    "n_tasks": len(per_task), "n_groups": len({groups[q] for q in per_task.index}),
                    "seed_pairs": ", ".join(f"{s}: {float(diffs[s].mean()):+.4f}" for s in diffs.columns),
                    "threshold": f"mean >= {bound:+.3f}, a terminal result for every task" if locked else "",
                    "met": bool(ci.estimate >= bound) if locked else None})
    return pd.DataFrame(out, columns=list(PASS_COLUMNS))


def pilot_verdict(recovery: pd.DataFrame, passes: pd.DataFrame, arms: pd.DataFrame) -> dict[str, bool | None]:
    """``{"meaningful": ..., "acceptable": ...}`` under :data:`THRESHOLDS` (None where a reading is
    missing). "acceptable" also needs every evaluate run complete (a terminal result per task)."""
    primary = recovery[(recovery["readout"] == "recovery") & (recovery["k"] == PRIMARY_K)] \
        if not recovery.empty else recovery
    needed = [("mistill", "vanilla-bf16"), ("mistill", "randheads")]
    found = {(r["arm"], r["reference"]): r["met"] for _, r in primary.iterrows()} if not primary.empty else {}
    meaningful = all(bool(found[c]) for c in needed) if all(c in found for c in needed) else None
    locked = passes[(passes["arm"] == "mistill") & (passes["reference"] == "vanilla-bf16")] \
        if not passes.empty else passes
    acceptable = None
    if len(locked):
        complete = bool(len(arms)) and bool(arms["complete"].all())
        acceptable = bool(locked["met"].iloc[0]) and complete
    return {"meaningful": meaningful, "acceptable": acceptable}

