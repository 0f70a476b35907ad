"""Corpus: notes, strict JSONL, the Edin MIMIC-IV loader (constructed table), App. A selection."""

from __future__ import annotations

import hashlib
import json

import pandas as pd
import pytest

from mistill.data.corpus import (Corpus, Note, eligible, find_discharge_diagnosis,
                                 load_mimic_edin, select_stratified, stratum_thresholds)
from mistill.data.inventory import Inventory
from mistill.errors import MistillInputError

CODES = ["F32.A", "G47.33", "D64.9", "M54.50", "A41.9", "C34.90", "L03.90", "R65.20", "K25.9",
         "J15.9", "N17.9", "I10", "E78.5", "N18.9", "J18.9", "K21.9", "E11.9", "I50.9", "J44.9"]


@pytest.fixture(scope="module")
def inv() -> Inventory:
    return Inventory.billable(order_seed=0, codes=CODES)


def _row(i: int, **kw) -> dict:
    row = {"note_id": f"n{i}", "patient_id": f"p{i}", "split": "test",
           "text": f"note {i} text", "gold_codes": ["N18.9", "I10"]}
    row.update(kw)
    return row


def _write(path, rows) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows),
                    encoding="utf-8")


def test_jsonl_roundtrip_and_digest(tmp_path, inv: Inventory) -> None:
    rows = [_row(1, gold_codes=["N189", "i10", "N18.9"]),
            _row(2, teacher_trace="<think>\nx\n</think>\n\n[\"I10\"]",
                 text="HPI.\nDischarge diagnoses:\nhypertension\n\nDischarge condition: ok",
                 discharge_diagnosis="Discharge diagnoses:\nhypertension", meta={"k": 1})]
    _write(tmp_path / "c.jsonl", rows)
    c = Corpus.from_jsonl(tmp_path / "c.jsonl", privacy="public", inventory=inv)
    assert c.name == "c" and c.privacy == "public" and c.text_loggable
    assert c.notes[0].gold_codes == ("N18.9", "I10")  # normalised, de-duplicated, order kept
    assert c.by_id["n2"].meta == {"k": 1}
    # digest: documented recipe, computed by hand
    h = hashlib.sha256()
    for n in c.notes:
        rec = [n.note_id, n.patient_id, n.split, n.text, list(n.gold_codes), n.teacher_trace,
               n.discharge_diagnosis]
        h.update(json.dumps(rec, ensure_ascii=False, separators=(",", ":")).encode() + b"\n")
    assert c.digest == h.hexdigest()
    c.to_jsonl(tmp_path / "out.jsonl")
    back = Corpus.from_jsonl(tmp_path / "out.jsonl", privacy="public", inventory=inv)
    assert back.digest == c.digest
    assert [n.to_dict() for n in back] == [n.to_dict() for n in c]
    changed = Corpus(name="c", privacy="public", inventory=inv,
                     notes=[c.notes[0], Note(**{**c.notes[1].__dict__, "text": c.notes[1].text
                                                + " "})])
    assert changed.digest != c.digest


def test_default_privacy_is_restricted(tmp_path, inv: Inventory) -> None:
    _write(tmp_path / "c.jsonl", [_row(1)])
    c = Corpus.from_jsonl(tmp_path / "c.jsonl", inventory=inv)
    assert c.privacy == "restricted" and not c.text_loggable
    with pytest.raises(MistillInputError, match="privacy"):
        Corpus(name="x", privacy="open", notes=[], inventory=inv)


@pytest.mark.parametrize("bad, line, note, field", [
    ('{"note_id": "n2", "patient_id": ', 2, None, None),
    (json.dumps({k: v for k, v in _row(2).items() if k != "split"}), 2, "n2", "split"),
    (json.dumps(_row(2, gold_codes=[])), 2, "n2", "gold_codes"),
    (json.dumps(_row(2, gold_codes=["N18.9", "J96.00"])), 2, "n2", "gold_codes"),
    (json.dumps(_row(2, gold_codes="N18.9")), 2, "n2", "gold_codes"),
    (json.dumps(_row(1)), 2, "n1", "note_id"),
    (json.dumps(_row(2, teacher_trace="<think>\nstill thinking")), 2, "n2", "teacher_trace"),
    (json.dumps(_row(2, discharge_diagnosis="not in text")), 2, "n2", "discharge_diagnosis"),
    ('["a list"]', 2, None, None),
])
def test_strict_loading_names_file_line_note_field(tmp_path, inv, bad, line, note, field) -> None:
    path = tmp_path / "bad.jsonl"
    _write(path, [_row(1), bad])
    with pytest.raises(MistillInputError) as err:
        Corpus.from_jsonl(path, inventory=inv)
    e = err.value
    assert (e.file, e.line, e.note, e.field) == (str(path), line, note, field)
    assert str(path) in str(e)


def test_unknown_code_message_names_code(tmp_path, inv) -> None:
    _write(tmp_path / "c.jsonl", [_row(1, gold_codes=["J96.00"])])
    with pytest.raises(MistillInputError, match="J96.00"):
        Corpus.from_jsonl(tmp_path / "c.jsonl", inventory=inv)


def test_split_subset_and_summary(inv) -> None:
    notes = [Note(f"n{i}", f"p{i}", "train" if i < 3 else "test", "SECRET-TEXT", ("I10",))
             for i in range(5)]
    c = Corpus(name="x", privacy="synthetic", notes=notes, inventory=inv)
    assert c.splits == ("train", "test")
    assert [n.note_id for n in c.split("test")] == ["n3", "n4"]
    assert c.split("test").privacy == "synthetic"
    assert [n.note_id for n in c.subset(["n4", "n0"])] == ["n4", "n0"]
    with pytest.raises(MistillInputError):
        c.subset(["nope"])
    s = c.summary()
    assert s["splits"] == {"train": 3, "test": 2} and s["n_notes"] == 5
    assert "SECRET-TEXT" not in json.dumps(s)  # safe to log for a restricted corpus
    assert set(s) >= {"digest", "inventory_digest", "n_patients"}
    with pytest.raises(MistillInputError, match="duplicate"):
        Corpus(name="x", privacy="synthetic", notes=notes + notes[:1], inventory=inv)
    hand = Corpus(name="x", privacy="synthetic", inventory=inv,
                  notes=[Note("h", "p", "test", "t", ("N189", "i10", "N18.9"))])
    assert hand.notes[0].gold_codes == ("N18.9", "I10")  # normalised on construction
    with pytest.raises(MistillInputError) as err:
        Corpus(name="x", privacy="synthetic", inventory=inv,
               notes=[Note("h", "p", "test", "t", ("N18.9",), teacher_trace="<think> open")])
    assert (err.value.note, err.value.field) == ("h", "teacher_trace")


# ---------------------------------------------------------------------------------------------
# MIMIC-IV (Edin et al. 2023) loader on a constructed table
# ---------------------------------------------------------------------------------------------

MIMIC_TEXT = ("name unit no admission date discharge date service medicine chief complaint "
              "dyspnea history of present illness ... discharge disposition home discharge "
              "diagnosis primary chronic kidney disease secondary hypertension discharge "
              "condition mental status clear and coherent discharge instructions ...")


def _mimic_tables(tmp_path):
    df = pd.DataFrame({
        "_id": [101, 102, 103],
        "note_id": ["1-DS-1", "2-DS-1", "3-DS-1"],
        "subject_id": [1, 2, 2],
        "text": [MIMIC_TEXT, "second note text", "third note text"],
        "icd10_diag": [["N18.9", "I10"], ["E11.9"], ["J44.9", "J18.9"]],
        "icd10_proc": [["0DTJ4ZZ"], [], ["5A1955Z"]],
    })
    split = pd.DataFrame({"_id": [101, 102, 103], "split": ["test", "train", "test"]})
    df.to_feather(tmp_path / "mimiciv_icd10.feather")
    split.to_feather(tmp_path / "mimiciv_icd10_split.feather")
    return df


def test_load_mimic_edin_feather_with_split_file(tmp_path, inv) -> None:
    _mimic_tables(tmp_path)
    c = load_mimic_edin(tmp_path / "mimiciv_icd10.feather", inv,
                        split_file=tmp_path / "mimiciv_icd10_split.feather")
    assert c.privacy == "restricted" and len(c) == 3
    n = c.by_id["101"]
    assert n.patient_id == "1" and n.split == "test" and n.gold_codes == ("N18.9", "I10")
    assert n.meta["note_id"] == "1-DS-1"
    assert n.discharge_diagnosis == ("discharge diagnosis primary chronic kidney disease "
                                     "secondary hypertension")
    assert all("0DTJ4ZZ" not in x.gold_codes for x in c)  # procedure codes dropped
    test = load_mimic_edin(tmp_path / "mimiciv_icd10.feather", inv, splits=["test"],
                           split_file=tmp_path / "mimiciv_icd10_split.feather")
    assert [x.note_id for x in test] == ["101", "103"]


def test_load_mimic_edin_csv_strings_and_split_column(tmp_path, inv) -> None:
    pd.DataFrame({"note_id": ["a", "b"], "subject_id": [7, 8], "text": ["x y", "z"],
                  "icd10_diag": ["N189;I10", "E11.9, J44.9"], "split": ["val", "test"]}
                 ).to_csv(tmp_path / "t.csv", index=False)
    c = load_mimic_edin(tmp_path / "t.csv", inv, id_column="note_id")
    assert c.by_id["a"].gold_codes == ("N18.9", "I10")
    assert c.by_id["b"].gold_codes == ("E11.9", "J44.9") and c.by_id["b"].split == "test"


def test_load_mimic_edin_errors(tmp_path, inv) -> None:
    df = _mimic_tables(tmp_path)
    path = tmp_path / "mimiciv_icd10.feather"
    with pytest.raises(MistillInputError) as err:  # no split column and no split file
        load_mimic_edin(path, inv)
    assert err.value.file == str(path) and err.value.field == "split"
    with pytest.raises(MistillInputError) as err:
        load_mimic_edin(path, inv, text_column="note_text",
                        split_file=tmp_path / "mimiciv_icd10_split.feather")
    assert err.value.field == "note_text" and err.value.file == str(path)
    with pytest.raises(MistillInputError, match="not found"):
        load_mimic_edin(tmp_path / "nope.feather", inv)
    df.loc[1, "icd10_diag"] = ["E11.9", "Z99.89"]  # not in the small inventory
    df.to_feather(path)
    with pytest.raises(MistillInputError, match="Z99.89") as err:
        load_mimic_edin(path, inv, split_file=tmp_path / "mimiciv_icd10_split.feather")
    assert err.value.note == "102" and err.value.field == "icd10_diag"
    c = load_mimic_edin(path, inv, split_file=tmp_path / "mimiciv_icd10_split.feather",
                        unknown_codes="drop")
    assert c.by_id["102"].gold_codes == ("E11.9",) and c.by_id["102"].meta["n_dropped_codes"] == 1


def test_find_discharge_diagnosis_variants() -> None:
    text = "HPI ...\nDischarge Diagnosis:\nCKD\nHTN\n\nDischarge Condition:\nstable"
    assert find_discharge_diagnosis(text) == "Discharge Diagnosis:\nCKD\nHTN"
    assert find_discharge_diagnosis("no such section here") is None
    tail = "x discharge diagnoses sepsis"
    assert find_discharge_diagnosis(tail) == "discharge diagnoses sepsis"


# ---------------------------------------------------------------------------------------------
# Selection (App. A)
# ---------------------------------------------------------------------------------------------

def test_eligible_bounds_inclusive(inv) -> None:
    codes5 = ("N18.9", "I10", "E11.9", "J44.9", "K21.9")
    note = Note("a", "p", "test", " ".join(["w"] * 800), codes5)
    assert eligible(note, inv)
    assert not eligible(Note("a", "p", "test", " ".join(["w"] * 799), codes5), inv)
    assert eligible(Note("a", "p", "test", " ".join(["w"] * 2500), codes5), inv)
    assert not eligible(Note("a", "p", "test", " ".join(["w"] * 2501), codes5), inv)
    assert not eligible(Note("a", "p", "test", " ".join(["w"] * 900), codes5[:4]), inv)
    # counted in the inventory: restricting the inventory can drop a note below 5 codes
    assert not eligible(note, inv.restrict(codes5[:4] + ("I50.9",)))
    assert eligible(note, inv, min_codes=4, max_words=900)


def _pool() -> dict[str, Note]:
    spec = {  # id: (patient, codes); blocks in comments
        "a1": ("pa1", ["I10"]),                                      # I10-I1A
        "a2": ("pa2", ["E78.5"]),                                    # E70-E88
        "b1": ("pb1", ["N18.9", "N17.9"]),                           # N17-N19 twice: gain 1
        "b2": ("pb2", ["J18.9", "K21.9"]),                           # J09-J18, K20-K31: gain 2
        "c1": ("pc1", ["F32.A", "G47.33", "D64.9"]),                 # three new blocks
        "c2": ("pc2", ["J15.9", "K25.9", "N17.9"]),                  # J, K covered by b2
        "d1": ("pd1", ["E11.9", "I50.9", "J44.9", "M54.50"]),        # four new blocks
        "d2": ("pb2", ["A41.9", "C34.90", "L03.90", "R65.20"]),      # same patient as b2
    }
    return {k: Note(k, p, "test", "text", tuple(c)) for k, (p, c) in spec.items()}


def test_stratum_thresholds_hand_values() -> None:
    assert stratum_thresholds([1, 1, 2, 2, 3, 3, 4, 4]) == (1.75, 2.5, 3.25)


def test_select_stratified_hand_case(inv) -> None:
    pool = _pool()
    for seed in range(5):
        picks = select_stratified(list(pool.values()), 4, inv, seed, filter_eligible=False)
        ids = [n.note_id for n in picks]
        # round robin over strata 0..3; greedy on new blocks; d2 excluded by b2's patient
        assert ids[0] in {"a1", "a2"} and ids[1:] == ["b2", "c1", "d1"]
        seven = select_stratified(list(pool.values()), 7, inv, seed, filter_eligible=False)
        assert [n.note_id for n in seven][4:] == [{"a1": "a2", "a2": "a1"}[ids[0]], "b1", "c2"]
    with pytest.raises(MistillInputError, match="distinct patients"):
        select_stratified(list(pool.values()), 8, inv, 0, filter_eligible=False)


def test_select_stratified_deterministic_and_order_free(inv) -> None:
    pool = list(_pool().values())
    a = select_stratified(pool, 6, inv, 11, filter_eligible=False)
    b = select_stratified(pool[::-1], 6, inv, 11, filter_eligible=False)
    assert [n.note_id for n in a] == [n.note_id for n in b]
    firsts = {select_stratified(pool, 1, inv, s, filter_eligible=False)[0].note_id
              for s in range(20)}
    assert firsts == {"a1", "a2"}  # the seed breaks the stratum-0 tie both ways


def test_select_stratified_filters_eligibility(inv) -> None:
    long = " ".join(["w"] * 900)
    codes = ("N18.9", "I10", "E11.9", "J44.9", "K21.9")
    notes = [Note("ok", "p1", "test", long, codes), Note("short", "p2", "test", "w w", codes)]
    picks = select_stratified(notes, 1, inv, 0)
    assert [n.note_id for n in picks] == ["ok"]
    with pytest.raises(MistillInputError):
        select_stratified(notes, 2, inv, 0)


# ---------------------------------------------------------------------------------------------
# Bytes that are not UTF-8, and note ids that cannot name a folder
# ---------------------------------------------------------------------------------------------

def test_non_utf8_byte_names_file_line_note_and_field(tmp_path, inv) -> None:
    path = tmp_path / "latin1.jsonl"
    good = json.dumps(_row(1)).encode("utf-8")
    bad = json.dumps(_row(2, text="caf\u00e9 note"), ensure_ascii=False).encode("latin-1")  # é as 0xE9
    path.write_bytes(good + b"\n" + bad + b"\n")
    with pytest.raises(MistillInputError) as err:
        Corpus.from_jsonl(path, inventory=inv)
    e = err.value
    assert (e.file, e.line, e.note, e.field) == (str(path), 2, "n2", "text")
    assert "0xE9" in str(e) and f"file {path} line 2" in str(e)


def test_non_utf8_byte_in_a_line_that_is_not_json_still_names_the_line(tmp_path, inv) -> None:
    path = tmp_path / "broken.jsonl"
    path.write_bytes(json.dumps(_row(1)).encode() + b"\n\n{\"note_id\": \"n2\xff\n")
    with pytest.raises(MistillInputError) as err:
        Corpus.from_jsonl(path, inventory=inv)
    assert (err.value.file, err.value.line, err.value.note, err.value.field) == (str(path), 3, None, None)


def test_non_utf8_byte_in_a_code_file_names_file_and_line(tmp_path) -> None:
    path = tmp_path / "codes.txt"
    path.write_bytes(b"I10\nN18.9\n# r\xe9sum\xe9 of the list\nE11.9\n")
    with pytest.raises(MistillInputError) as err:
        Inventory.from_code_file(path)
    assert (err.value.file, err.value.line) == (str(path), 3)
    assert "0xE9" in str(err.value)


def test_non_utf8_byte_in_a_csv_split_file_names_file_line_and_column(tmp_path, inv) -> None:
    _mimic_tables(tmp_path)
    split = tmp_path / "split.csv"
    split.write_bytes(b"_id,split\n101,test\n102,tr\xe4in\n103,test\n")
    with pytest.raises(MistillInputError) as err:
        load_mimic_edin(tmp_path / "mimiciv_icd10.feather", inv, split_file=split)
    assert (err.value.file, err.value.line, err.value.field) == (str(split), 3, "split")


UNSAFE_IDS = ["../../x", "a/b", "a\\b", ".hidden", "n1\n", "a\tb", "a\x00b", "n 1", "n1/"]
"""Note ids the old loader accepted although they cannot name a per-note artifact folder."""


def test_note_ids_must_name_a_folder(tmp_path, inv) -> None:
    path = tmp_path / "ids.jsonl"
    for note_id in UNSAFE_IDS:
        _write(path, [_row(1), _row(2, note_id=note_id)])
        with pytest.raises(MistillInputError) as err:
            Corpus.from_jsonl(path, inventory=inv)
        e = err.value
        assert (e.file, e.line, e.note, e.field) == (str(path), 2, note_id, "note_id"), note_id
        with pytest.raises(MistillInputError) as err:  # hand-built notes too (synthetic, MIMIC)
            Corpus(name="x", privacy="synthetic", inventory=inv,
                   notes=[Note(note_id, "p", "test", "text", ("I10",))])
        assert (err.value.note, err.value.field) == (note_id, "note_id"), note_id
    # the rule is the artifact folders' rule, no stricter: these load
    ids = ["n1", "1-DS-1", "_x", "a.b_c-d", "10000032"]
    _write(path, [_row(i, note_id=nid) for i, nid in enumerate(ids)] + [_row(9, note_id=12345)])
    assert [n.note_id for n in Corpus.from_jsonl(path, inventory=inv)] == ids + ["12345"]


def test_unsafe_mimic_note_id_names_file_note_and_column(tmp_path, inv) -> None:
    pd.DataFrame({"note_id": ["a", "../b"], "subject_id": [7, 8], "text": ["x y", "z"],
                  "icd10_diag": ["N189;I10", "E11.9"], "split": ["val", "test"]}
                 ).to_csv(tmp_path / "t.csv", index=False)
    with pytest.raises(MistillInputError) as err:
        load_mimic_edin(tmp_path / "t.csv", inv, id_column="note_id")
    assert (err.value.file, err.value.note, err.value.field) == (str(tmp_path / "t.csv"), "../b", "note_id")
