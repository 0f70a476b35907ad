"""Inventory: the billable ICD-10-CM list, its shared seeded order, lookups and persistence."""

from __future__ import annotations

import hashlib
import json
import random
import time

import pytest

from mistill.data.inventory import (Inventory, billable_codes, category, chapter_letter,
                                    icd10_block, icd10_chapter, normalize)
from mistill.errors import MistillInputError

SMALL = ["N18.1", "N18.9", "N18.4", "E11.9", "E11.65", "I10", "J18.9", "T07.XXXS"]


@pytest.fixture(scope="module")
def full() -> Inventory:
    return Inventory.billable(order_seed=0)


def test_billable_count_letters_and_cache(full: Inventory) -> None:
    # simple-icd-10-cm 1.5.0 lists 74,724 billable entries; five names (B20, F99, P84, R99, Z66)
    # are both a block and a category and appear twice, so 74,719 distinct codes.
    assert len(full) == 74_719
    assert len(set(full.codes)) == len(full)
    assert len(full.letters) == 26 and full.letters[0] == "A" and full.letters[-1] == "Z"
    t = time.perf_counter()
    again = Inventory.billable(order_seed=0)
    assert again is full
    assert time.perf_counter() - t < 0.05


def test_order_is_seeded_shuffle_of_sorted(full: Inventory) -> None:
    expected = sorted(billable_codes())
    random.Random(0).shuffle(expected)
    assert list(full.codes) == expected
    other = Inventory.billable(order_seed=1)
    assert set(other.codes) == set(full.codes)
    assert other.codes != full.codes
    assert other.digest != full.digest


def test_normalize_forms() -> None:
    for raw in ("N189", "n18.9", " N18.9 ", "N18.9\n"):
        assert normalize(raw) == "N18.9"
    assert normalize("I10") == "I10"
    assert normalize("t07xxxs") == "T07.XXXS"
    assert normalize("QA00142") == "QA0.0142"  # FY2026: a letter in second place
    assert all(normalize(c) == c for c in billable_codes())  # every code is well-formed
    with pytest.raises(MistillInputError, match="malformed"):
        normalize("18.9N")
    with pytest.raises(MistillInputError, match="not a billable"):
        normalize("N18")  # a category with children
    with pytest.raises(MistillInputError, match="not a billable"):
        normalize("N18.7")  # well-formed, does not exist
    assert normalize("N187", strict=False) == "N18.7"
    assert normalize(" junk ", strict=False) == "JUNK"


def test_category_letter_block_chapter() -> None:
    assert category("N18.9") == "N18" and chapter_letter("N18.9") == "N"
    assert icd10_block("N18.9") == "N17-N19"
    assert icd10_block("N189") == "N17-N19"
    assert icd10_block("I10") == "I10-I1A"
    assert icd10_block("B20") == "B20"  # single-category block named like its category
    assert icd10_chapter("N18.9") == "14"
    with pytest.raises(MistillInputError):
        icd10_block("Q99.99")


def test_restricted_lookups() -> None:
    inv = Inventory.billable(order_seed=3, codes=["N189", "n18.1", "N18.4", "E11.9", "E1165",
                                                   "I10", "J18.9", "T07.XXXS", "N18.9"])
    assert len(inv) == 8  # the duplicate N18.9 collapsed
    expected = sorted(SMALL)
    random.Random(3).shuffle(expected)
    assert list(inv.codes) == expected
    assert "N189" in inv and "N18.9" in inv and " n18.9 " in inv
    assert "N18.2" not in inv and 5 not in inv
    assert set(inv.siblings("N18.9")) == {"N18.1", "N18.4"}
    assert [inv.index(c) for c in inv.siblings("N18.9")] == sorted(
        inv.index(c) for c in inv.siblings("N18.9"))
    assert inv.siblings("I10") == ()
    assert set(inv.siblings("N18.2")) == {"N18.1", "N18.4", "N18.9"}  # category is what counts
    assert inv.line("n189") == "N18.9 Chronic kidney disease, unspecified"
    assert inv.letters == ("E", "I", "J", "N", "T")
    assert inv.normalize("e1165") == "E11.65"
    with pytest.raises(MistillInputError, match="not in the inventory"):
        inv.normalize("N18.2")
    assert inv.lines() == [f"{c} {inv.descriptions[c]}" for c in inv.codes]


def test_unknown_code_in_explicit_list_names_it() -> None:
    with pytest.raises(MistillInputError, match="N18.7"):
        Inventory.billable(codes=["N18.9", "N18.7"])


def test_restrict_keeps_parent_order() -> None:
    parent = Inventory.billable(order_seed=5, codes=SMALL)
    child = parent.restrict(["E11.9", "N18.9", "N18.1"])
    assert list(child.codes) == [c for c in parent.codes if c in {"E11.9", "N18.9", "N18.1"}]
    assert child.order_seed == 5
    assert dict(child.descriptions) == {c: parent.descriptions[c] for c in child.codes}
    with pytest.raises(MistillInputError, match="J44.9"):
        parent.restrict(["J44.9"])


def test_digest_is_sha256_of_ordered_lines() -> None:
    inv = Inventory.billable(order_seed=0, codes=SMALL)
    lines = "\n".join(f"{c} {inv.descriptions[c]}" for c in inv.codes)
    assert inv.digest == hashlib.sha256(lines.encode("utf-8")).hexdigest()
    assert Inventory.billable(order_seed=0, codes=SMALL) == inv
    assert Inventory.billable(order_seed=1, codes=SMALL).digest != inv.digest


def test_immutable() -> None:
    inv = Inventory.billable(codes=SMALL)
    with pytest.raises(Exception):
        inv.codes = ()  # type: ignore[misc]
    with pytest.raises(TypeError):
        inv.descriptions["N18.9"] = "x"  # type: ignore[index]


def test_from_code_file(tmp_path) -> None:
    p = tmp_path / "codes.txt"
    p.write_text("# MIMIC diagnosis codes\nN189\nE11.9\n\n i10 \n", encoding="utf-8")
    inv = Inventory.from_code_file(p, order_seed=2)
    assert set(inv.codes) == {"N18.9", "E11.9", "I10"} and inv.order_seed == 2
    bad = tmp_path / "bad.txt"
    bad.write_text("N18.9\nE11.9\nN18.7\n", encoding="utf-8")
    with pytest.raises(MistillInputError) as err:
        Inventory.from_code_file(bad)
    assert err.value.file == str(bad) and err.value.line == 3 and "N18.7" in str(err.value)
    with pytest.raises(MistillInputError, match="not found"):
        Inventory.from_code_file(tmp_path / "missing.txt")


def test_json_roundtrip_and_tamper(tmp_path) -> None:
    inv = Inventory.billable(order_seed=7, codes=SMALL)
    path = inv.to_json(tmp_path / "inventory.json")
    back = Inventory.from_json(path)
    assert back.codes == inv.codes and back.digest == inv.digest and back.order_seed == 7
    data = json.loads(path.read_text(encoding="utf-8"))
    data["descriptions"]["N18.9"] = "edited"
    (tmp_path / "edited.json").write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(MistillInputError, match="digest") as err:
        Inventory.from_json(tmp_path / "edited.json")
    assert err.value.file == str(tmp_path / "edited.json")
    del data["codes"]
    (tmp_path / "nocodes.json").write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(MistillInputError) as err:
        Inventory.from_json(tmp_path / "nocodes.json")
    assert err.value.field == "codes"


def test_custom_inventory_validation() -> None:
    with pytest.raises(MistillInputError, match="twice"):
        Inventory(codes=("A", "A"), descriptions={"A": "x"})
    with pytest.raises(MistillInputError, match="no description"):
        Inventory(codes=("A", "B"), descriptions={"A": "x"})
    labels = Inventory(codes=("L2", "L1"), descriptions={"L1": "one", "L2": "two"})
    assert labels.lines() == ["L2 two", "L1 one"]
