"""Two characterizations side by side (Tables 9, 35, 36) and the patient-level collapse of the
knock-in cells (App. C): the pure functions on hand-made inputs, then the report's tables built
from runs on the real test MLflow server, checked against an independent computation."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from analysis_fixtures import TEACHER, make_run
from mlflow.tracking import MlflowClient
from scipy.stats import spearmanr
from stage_fixtures import unique

from analysis.characterization_compare import (compare_rankings, compared_runs, knockin_side_by_side,
                                               patient_collapse_table, patient_rows, ranking_agreement,
                                               readside_patient_collapse)
from mistill import stats
from mistill.config import Config
from mistill.errors import MistillInputError
from mistill.stages.characterize import AttributeConfig
from mistill.stages.report import ReportConfig, run_report

pytestmark = pytest.mark.usefixtures("pinned_code_version")

PHASES = ("P1", "P2", "P2C")
NOTES = [f"n{i:02d}" for i in range(6)]
PATIENTS = {"n00": "p0", "n01": "p0", "n02": "p1", "n03": "p2", "n04": "p2", "n05": "p3"}
HEADS = [f"L{h // 4}H{h % 4}" for h in range(48)]
OTHER_HEADS = [f"L{h // 8}H{h % 8}" for h in range(64)]  # a second reasoner's geometry
REASONER = "reasoner-2"


# ------------------------------------------------------------------------ hand-made inputs
def _importance(seed: int, heads: list[str], base: np.ndarray | None = None) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for i, phase in enumerate(PHASES):
        x = rng.normal(0, 1, len(heads)) if base is None else base[phase] + rng.normal(0, 0.7, len(heads))
        out[phase] = x
    return out


def _head_sets(importance: dict[str, np.ndarray], heads: list[str], n_notes: int = 6) -> dict:
    doc: dict = {"meta": {"n_heads": len(heads)}}
    for phase, x in importance.items():
        order = np.lexsort((np.arange(x.size), -x))
        doc[phase] = {"ranking": [heads[h] for h in order], "importance_c": [float(x[h]) for h in order],
                      "n_notes": n_notes}
    return doc


def _per_note_sets(seed: int) -> pd.DataFrame:
    """Per-note cells with known values: the global set well above random, a few NaNs."""
    rng = np.random.default_rng(seed)
    rows = []
    for note in NOTES:
        for phase in PHASES:
            for k in (8, 40):
                for s, centre in (("global", 0.6), ("random", 0.05), ("bottom", -0.2), ("own", 0.5)):
                    rec = float(centre + rng.normal(0, 0.2))
                    rows.append({"note_id": note, "phase": phase, "k": k, "set": s,
                                 "necessity": float(centre + 0.1 + rng.normal(0, 0.2)),
                                 "recovery": np.nan if (note == "n02" and phase == "P2C") else rec,
                                 "n_events": 3, "n_gated": 2})
    return pd.DataFrame(rows)


BASE = _importance(1, HEADS)
SETS_A = _head_sets(BASE, HEADS)
SETS_B = _head_sets(_importance(2, HEADS, BASE), HEADS)
SETS_C = _head_sets(_importance(3, OTHER_HEADS), OTHER_HEADS)


def _expected_agreement(a: dict, b: dict, phase: str, k: int) -> tuple[float, int]:
    ia = dict(zip(a[phase]["ranking"], a[phase]["importance_c"]))
    ib = dict(zip(b[phase]["ranking"], b[phase]["importance_c"]))
    rho = spearmanr([ia[h] for h in HEADS], [ib[h] for h in HEADS]).statistic
    return float(rho), len(set(a[phase]["ranking"][:k]) & set(b[phase]["ranking"][:k]))


def test_ranking_agreement_on_a_small_ranking():
    # a: h0 > h1 > h2 > h3; b swaps h1 and h2 and ranks h3 first
    out = ranking_agreement(["h0", "h1", "h2", "h3"], [4, 3, 2, 1], ["h3", "h0", "h2", "h1"], [9, 8, 7, 6],
                            ks=(1, 2, 8))
    assert out["n_heads"] == 4
    assert out["spearman"] == pytest.approx(spearmanr([4, 3, 2, 1], [8, 6, 7, 9]).statistic)
    assert (out["top_overlap.1"], out["top_overlap.2"], out["top_overlap.8"]) == (0, 1, 4)
    assert out["top_k.8"] == 4  # clipped to the ranking's length
    # two geometries (two models): no head-by-head comparison
    other = ranking_agreement(["a", "b"], [1, 0], ["c", "d"], [1, 0], ks=(1,))
    assert other["n_heads"] == 0 and np.isnan(other["spearman"]) and np.isnan(other["top_overlap.1"])
    with pytest.raises(MistillInputError):
        ranking_agreement(["a", "b"], [1.0], ["a", "b"], [1.0, 0.0])


def test_compare_rankings_matches_scipy():
    table = compare_rankings(SETS_A, SETS_B).set_index("phase")
    assert list(table.index) == list(PHASES)  # NULL has no I_c ranking
    for phase in PHASES:
        rho, shared40 = _expected_agreement(SETS_A, SETS_B, phase, 40)
        assert table.at[phase, "spearman"] == pytest.approx(rho)
        assert table.at[phase, "top_overlap.40"] == shared40
        assert table.at[phase, "top_overlap.8"] == _expected_agreement(SETS_A, SETS_B, phase, 8)[1]
        assert table.at[phase, "n_heads"] == len(HEADS)


def test_knockin_side_by_side_medians_and_wins():
    a, b = _per_note_sets(10), _per_note_sets(11)
    table = knockin_side_by_side(a, b).set_index(["phase", "k"])
    for side, rows in (("a", a), ("b", b)):
        g = rows[(rows["phase"] == "P1") & (rows["k"] == 8)].set_index(["set", "note_id"])["recovery"]
        assert table.at[("P1", 8), f"recovery.global.{side}"] == pytest.approx(g["global"].median())
        assert table.at[("P1", 8), f"recovery.random.{side}"] == pytest.approx(g["random"].median())
        wins = int((g["global"] > g["random"]).sum())
        assert table.at[("P1", 8), f"recovery.wins_vs_random.{side}"] == wins
    # one side without a knock-in run: that side's columns are simply absent
    only = knockin_side_by_side(a, pd.DataFrame())
    assert "recovery.global.a" in only.columns and "recovery.global.b" not in only.columns


def test_patient_rows_average_each_patients_notes():
    rows = pd.DataFrame([
        {"note_id": "n1", "phase": "P1", "k": 8, "set": "global", "necessity": 0.2, "recovery": 0.4, "n_gated": 2},
        {"note_id": "n2", "phase": "P1", "k": 8, "set": "global", "necessity": 0.6, "recovery": np.nan, "n_gated": 0},
        {"note_id": "n3", "phase": "P1", "k": 8, "set": "global", "necessity": 1.0, "recovery": 0.9, "n_gated": 3}])
    out = patient_rows(rows, {"n1": "p", "n2": "p", "n3": "q"}).set_index("note_id")
    assert out.at["p", "necessity"] == pytest.approx(0.4)
    assert out.at["p", "recovery"] == pytest.approx(0.4)  # the note without a gated event left out
    assert (out.at["p", "n_gated"], out.at["p", "n_notes"], out.at["q", "n_notes"]) == (2, 2, 1)
    with pytest.raises(MistillInputError):
        patient_rows(rows, {"n1": "p"})


def _collapsed_by_hand(rows: pd.DataFrame, phase: str, k: int, measure: str) -> tuple[float, float, int, int]:
    """The per-note and per-patient medians of the global set and its wins over random, computed
    without the module."""
    cell = rows[(rows["phase"] == phase) & (rows["k"] == k)].copy()
    cell["patient"] = cell["note_id"].map(PATIENTS)
    per_patient = cell.groupby(["set", "patient"])[measure].mean()
    note_median = cell[cell["set"] == "global"][measure].median()
    patient_median = per_patient["global"].median()
    both = pd.concat([per_patient["global"], per_patient["random"]], axis=1).dropna()
    wins = int((both.iloc[:, 0] > both.iloc[:, 1]).sum())
    return float(note_median), float(patient_median), wins, int(len(both))


def test_patient_collapse_table_against_a_hand_computation():
    rows = _per_note_sets(12)
    table = patient_collapse_table(rows, PATIENTS)
    for phase, k, m in (("P1", 8, "recovery"), ("P2C", 40, "recovery"), ("P2", 8, "necessity")):
        r = table[(table["phase"] == phase) & (table["k"] == k) & (table["set"] == "global")].iloc[0]
        note, patient, wins, n = _collapsed_by_hand(rows, phase, k, m)
        assert r[f"{m}.note"] == pytest.approx(note) and r[f"{m}.patient"] == pytest.approx(patient)
        assert r[f"{m}.move"] == pytest.approx(patient - note)
        assert (r[f"{m}.wins.patient"], r[f"{m}.n.patient"]) == (wins, n)
        assert r[f"{m}.sign_p.patient"] == pytest.approx(stats.sign_test(wins, n - wins))
    assert set(table["n_notes"]) == {6} and set(table["n_patients"]) == {4}
    # every note its own patient: the collapse changes nothing
    same = patient_collapse_table(rows, {n: n for n in NOTES})
    assert np.allclose(same["recovery.move"].dropna(), 0) and np.allclose(same["necessity.move"], 0)


def _note_lifts(seed: int) -> pd.DataFrame:
    """Per-note region lifts with known values: the top-k well above random, one NaN lift (a group
    without heads) and a phase one note lacks."""
    rng = np.random.default_rng(seed)
    rows = []
    for note in NOTES:
        for phase in PHASES:
            if phase == "P2" and note == "n05":
                continue
            for group, centre in (("top", 3.0), ("random", 1.0), ("bottom", 0.8)):
                lift = np.nan if (group == "bottom" and phase == "P2") else float(centre + rng.normal(0, 0.5))
                rows.append({"note_id": note, "phase": phase, "group": group, "lift": lift})
    return pd.DataFrame(rows)


def _lift_collapsed_by_hand(rows: pd.DataFrame, phase: str, group: str) -> tuple[float, float, int, int]:
    cell = rows[(rows["phase"] == phase) & (rows["group"] == group)].dropna(subset=["lift"])
    per_patient = cell.assign(p=cell["note_id"].map(PATIENTS)).groupby("p")["lift"].mean()
    return float(cell["lift"].median()), float(per_patient.median()), len(cell), len(per_patient)


def test_readside_patient_collapse_against_a_hand_computation():
    rows = _note_lifts(5)
    table = readside_patient_collapse(rows, PATIENTS).set_index(["phase", "group"])
    for phase, group in (("P1", "top"), ("P2", "random"), ("P2C", "bottom")):
        note, patient, n_notes, n_patients = _lift_collapsed_by_hand(rows, phase, group)
        r = table.loc[(phase, group)]
        assert r["lift.note"] == pytest.approx(note) and r["lift.patient"] == pytest.approx(patient)
        assert r["lift.move"] == pytest.approx(patient - note)
        assert (r["n_notes"], r["n_patients"]) == (n_notes, n_patients)
    assert table.loc[("P2", "top"), "n_notes"] == 5 and ("P2", "bottom") not in table.index
    same = readside_patient_collapse(rows, {n: n for n in NOTES})
    assert np.allclose(same["lift.move"], 0)
    with pytest.raises(MistillInputError):
        readside_patient_collapse(rows, {"n00": "p0"})


LOCUS_METRICS = {"a": {"locus/share_window": 0.36, "locus/median_window_distance": 7.0, "locus/n_mentions": 40.0},
                 "b": {"locus/share_window": 0.30, "locus/median_window_distance": 9.0}}
READSIDE_METRICS = {"a": {"readside/P1/lift_top": 3.0, "readside/P1/lift_random": 1.0},
                    "b": {"readside/P1/lift_top": 2.5, "readside/P1/lift_random": 1.1}}


def _locus_sets(seed: int, attribute_sets: dict) -> dict:
    """A locus run's rankings: prose time shares its first two heads with the chapter top-8."""
    rng = np.random.default_rng(seed)
    chapter = attribute_sets["P1"]["ranking"]
    rest = [h for h in HEADS if h not in chapter[:8]]
    order = chapter[:2] + list(rng.permutation(rest)) + chapter[2:8]
    prose = {h: float(len(order) - i) for i, h in enumerate(order)}
    transport = dict(zip(HEADS, rng.normal(0, 1, len(HEADS)).tolist()))
    return {name: {"ranking": sorted(v, key=lambda h: -v[h]), "importance_c": sorted(v.values(), reverse=True),
                   "n_notes": 6} for name, v in (("prose_time", prose), ("transport", transport))}


# ------------------------------------------------------------------------ runs on the server
@dataclasses.dataclass(frozen=True)
class _PrepareLike(Config):
    tag: str = ""


@dataclasses.dataclass(frozen=True)
class _KnockinLike(Config):
    tag: str = ""
    sets_run: str = ""


@pytest.fixture(scope="module")
def runs(tracking_uri, tmp_path_factory):
    corpus = unique("compare")
    root = tmp_path_factory.mktemp("writers")
    index = pd.DataFrame({"note_id": NOTES, "patient_id": [PATIENTS[n] for n in NOTES], "split": "val"})
    prepare = make_run(tracking_uri, corpus, "prepare", root, model=TEACHER, cfg=_PrepareLike(tag=corpus),
                       tables={"corpus_index": index})
    ids: dict = {"prepare": prepare}
    for model in (TEACHER, REASONER):
        ids[f"events-{model}"] = make_run(tracking_uri, corpus, "events", root, model=model,
                                          cfg=_PrepareLike(tag=f"events-{model}"), inputs={"prepare": prepare})
    for name, model, sets, detach, seed in (("a", TEACHER, SETS_A, False, 20), ("b", TEACHER, SETS_B, True, 21),
                                            ("c", REASONER, SETS_C, False, 22)):
        ids[name] = make_run(tracking_uri, corpus, "attribute", root, model=model,
                             cfg=AttributeConfig(events_run=ids[f"events-{model}"], detach=detach),
                             inputs={"events": ids[f"events-{model}"]}, jsons={"head_sets": sets})
        ids[f"per_note_{name}"] = _per_note_sets(seed)
        ids[f"knockin_{name}"] = make_run(tracking_uri, corpus, "knockin", root, model=model,
                                          cfg=_PrepareLike(tag=f"knockin-{name}"), inputs={"attribute": ids[name]},
                                          tables={"per_note_sets": ids[f"per_note_{name}"]})
    # the instruction control (Table 4): "a"'s sets knocked into "b"'s traces, a run newer than
    # "b"'s own knock-in that neither Tables 1/10 nor the pairs read
    ids["per_note_sets_on_b"] = _per_note_sets(50)
    ids["knockin_sets"] = make_run(tracking_uri, corpus, "knockin", root, model=TEACHER,
                                   cfg=_KnockinLike(tag="sets-of-a", sets_run=ids["a"]), inputs={"attribute": ids["b"]},
                                   tables={"per_note_sets": ids["per_note_sets_on_b"]})
    # the two characterizations' locus and read-side runs (Tables 35, 37); the read_side run of "a"
    # is its model's newest, so the patient collapse reads it
    for side, sets, seed in (("a", SETS_A, 40), ("b", SETS_B, 41)):
        ids[f"locus_sets_{side}"] = _locus_sets(seed, sets)
        ids[f"locus_{side}"] = make_run(tracking_uri, corpus, "locus", root, model=TEACHER,
                                        cfg=_PrepareLike(tag=f"locus-{side}"), inputs={"attribute": ids[side]},
                                        metrics=LOCUS_METRICS[side], jsons={"head_sets": ids[f"locus_sets_{side}"]})
    ids["read_side_b"] = make_run(tracking_uri, corpus, "read_side", root, model=TEACHER,
                                  cfg=_PrepareLike(tag="read_side-b"), inputs={"attribute": ids["b"]},
                                  metrics=READSIDE_METRICS["b"])
    ids["note_lifts"] = _note_lifts(30)
    ids["read_side"] = make_run(tracking_uri, corpus, "read_side", root, model=TEACHER,
                                cfg=_PrepareLike(tag="read_side-a"), inputs={"attribute": ids["a"]},
                                metrics=READSIDE_METRICS["a"], tables={"readside_note_lifts": ids["note_lifts"]})
    mp = pytest.MonkeyPatch()
    mp.setenv("MISTILL_ROOT", str(tmp_path_factory.mktemp("reader")))
    try:
        ids["report"] = run_report(ReportConfig(
            corpus=corpus, bootstrap=20, corpus_bootstrap=20,
            compare_attribute_runs=(ids["a"], ids["b"], ids["a"], ids["c"]),
            compare_labels=("intact", "detached", "teacher", "reasoner2")))
    finally:
        mp.undo()
    ids["corpus"] = corpus
    return ids, tmp_path_factory.mktemp("read")


def _csv(runs, name: str) -> pd.DataFrame:
    ids, dst = runs
    return pd.read_csv(Path(MlflowClient().download_artifacts(ids["report"], f"tables/{name}.csv", str(dst))))


def test_report_rankings_table_is_scipys(runs):
    table = _csv(runs, "compare_rankings")
    assert set(zip(table["label_a"], table["label_b"])) == {("intact", "detached")}  # the second pair: two models
    for _, r in table.iterrows():
        rho, shared40 = _expected_agreement(SETS_A, SETS_B, r["phase"], 40)
        assert r["spearman"] == pytest.approx(rho) and r["top_overlap.40"] == shared40
        assert r["top_overlap.16"] == _expected_agreement(SETS_A, SETS_B, r["phase"], 16)[1]
    ids, dst = runs
    shown = Path(MlflowClient().download_artifacts(ids["report"], "tables/compare_rankings.tex",
                                                   str(dst))).read_text()
    assert "Spearman" in shown and "intact" in shown
    report = Path(MlflowClient().download_artifacts(ids["report"], "report.md", str(dst))).read_text()
    assert "Tables 9 and 35" in report and ids["a"][:8] in report  # the caption names the runs compared


def test_report_knockin_side_by_side_and_second_reasoner(runs):
    ids, _ = runs
    table = _csv(runs, "compare_knockin")
    pair = table[(table["label_a"] == "teacher") & (table["label_b"] == "reasoner2")]
    assert len(pair) == len(PHASES) * 2  # (phase, k) cells of both runs
    for side, name in (("a", "a"), ("b", "c")):
        rows = ids[f"per_note_{name}"]
        g = rows[(rows["phase"] == "P2") & (rows["k"] == 40) & (rows["set"] == "global")]["recovery"]
        r = pair[(pair["phase"] == "P2") & (pair["k"] == 40)].iloc[0]
        assert r[f"recovery.global.{side}"] == pytest.approx(g.median())


def test_report_patient_collapse(runs):
    ids, _ = runs
    table = _csv(runs, "patient_collapse")
    assert set(table["run_id"]) == {ids["knockin_a"], ids["knockin_b"], ids["knockin_c"]}
    r = table[(table["run_id"] == ids["knockin_b"]) & (table["phase"] == "P1") & (table["k"] == 8)
              & (table["set"] == "global")].iloc[0]
    note, patient, wins, n = _collapsed_by_hand(ids["per_note_b"], "P1", 8, "recovery")
    assert r["recovery.note"] == pytest.approx(note) and r["recovery.patient"] == pytest.approx(patient)
    assert (r["recovery.wins.patient"], r["recovery.n.patient"]) == (wins, n)
    assert (r["n_notes"], r["n_patients"]) == (6, 4)


def test_report_readside_patient_collapse(runs):
    ids, _ = runs
    table = _csv(runs, "readside_patient_collapse")
    assert set(table["run_id"]) == {ids["read_side"]} and set(table["model"]) == {TEACHER}
    r = table[(table["phase"] == "P1") & (table["group"] == "top")].iloc[0]
    note, patient, n_notes, n_patients = _lift_collapsed_by_hand(ids["note_lifts"], "P1", "top")
    assert r["lift.note"] == pytest.approx(note) and r["lift.patient"] == pytest.approx(patient)
    assert (r["n_notes"], r["n_patients"]) == (n_notes, n_patients) == (6, 4)


def test_report_locus_and_read_side_side_by_side(runs):
    ids, _ = runs
    locus = _csv(runs, "compare_locus")
    pair = locus[(locus["label_a"] == "intact") & (locus["label_b"] == "detached")].set_index("metric")
    assert pair.at["locus/share_window", "a"] == pytest.approx(0.36) and pair.at["locus/share_window", "b"] == \
        pytest.approx(0.30)
    assert pair.at["locus/median_window_distance", "b_minus_a"] == pytest.approx(2.0)
    assert np.isnan(pair.at["locus/n_mentions", "b"])  # logged by one run only
    for name in ("prose_time", "transport"):
        a, b = ids["locus_sets_a"][name], ids["locus_sets_b"][name]
        ia, ib = dict(zip(a["ranking"], a["importance_c"])), dict(zip(b["ranking"], b["importance_c"]))
        rho = spearmanr([ia[h] for h in HEADS], [ib[h] for h in HEADS]).statistic
        assert pair.at[f"{name}/spearman", "a"] == pytest.approx(rho)
        assert pair.at[f"{name}/top_overlap/8", "a"] == len(set(a["ranking"][:8]) & set(b["ranking"][:8]))
    # each prose-time set shares exactly its first two heads with its chapter top-8
    assert pair.at["prose_time/chapter_overlap/8", "a"] == 2 and pair.at["prose_time/chapter_overlap/8", "b"] == 2
    layers = [int(h[1:].split("H")[0]) for h in ids["locus_sets_a"]["prose_time"]["ranking"][:40]]
    assert pair.at["prose_time/median_layer", "a"] == pytest.approx(float(np.median(layers)))
    read = _csv(runs, "compare_read_side").set_index("metric")
    assert read.at["readside/P1/lift_top", "a"] == 3.0 and read.at["readside/P1/lift_top", "b_minus_a"] == \
        pytest.approx(-0.5)


def test_report_instruction_control(runs):
    ids, _ = runs
    table = _csv(runs, "table4_instruction_control")
    assert set(table["run_id"]) == {ids["knockin_sets"]}
    rows = {(int(r["reading"]), r["phase"], r["statistic"]): r for _, r in table.iterrows()}
    new = ids["per_note_sets_on_b"]
    for phase in ("P1", "P2C"):
        cell = new[(new["phase"] == phase) & (new["k"] == 8)].pivot(index="note_id", columns="set", values="recovery")
        both = cell[["global", "random"]].dropna()
        assert rows[(1, phase, "k8 wins_vs_random")]["value"] == int((both["global"] > both["random"]).sum())
        ref = ids["per_note_a"]
        own = rows[(1, phase, "k40 recovery of the reference's global set (reference: its own, same notes)")]
        assert own["reference"] == pytest.approx(ref[(ref["phase"] == phase) & (ref["k"] == 40)
                                                     & (ref["set"] == "global")]["recovery"].median())
        assert rows[(2, phase, "heads shared by the re-ranked and the reference's top-40")]["value"] == \
            _expected_agreement(SETS_A, SETS_B, phase, 40)[1]
    window = rows[(3, "P1", "share of chapter mentions with a window locus (reference: the reference's)")]
    assert (window["value"], window["reference"]) == (pytest.approx(0.30), pytest.approx(0.36))
    prose = rows[(4, "P1", "heads the prose-time top-8 shares with the chapter top-8")]
    assert prose["value"] == 2
    # the knock-in of "a"'s sets is not "b"'s own: Tables 1/10 and the pairs read the own one
    collapse = _csv(runs, "patient_collapse")
    assert ids["knockin_sets"] not in set(collapse["run_id"])


def test_unnamed_pair_found_and_explicit_pairs_checked(runs):
    ids, _ = runs
    client = MlflowClient()
    attribute, knockin = compared_runs(client, f"mistill/{ids['corpus']}")
    assert list(attribute["run_id"]) == [ids["a"], ids["b"]]  # detach=false first
    assert list(attribute["label"]) == ["detach=false", "detach=true"]
    assert list(knockin["run_id"]) == [ids["knockin_a"], ids["knockin_b"]]
    with pytest.raises(MistillInputError):
        compared_runs(client, f"mistill/{ids['corpus']}", (ids["a"],))
    with pytest.raises(MistillInputError):
        compared_runs(client, f"mistill/{ids['corpus']}", (ids["a"], ids["knockin_b"]))
    with pytest.raises(MistillInputError):
        ReportConfig(compare_attribute_runs=(ids["a"],))
