"""The paper's result index (mistill/results_index.yaml) against the paper, MLproject and its page."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mistill.errors import MistillInputError
from mistill.results_index import (DATA_FILE, REGENERATE, STATUSES, ResultEntry, expected_ids, load,
                                   paper_result_ids, render_markdown, validate)

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "RESULTS_INDEX.md"
PAPER = REPO.parent / "shared" / "paper" / "characterize-then-distill.txt"
"""The paper lives beside the repository, not in it; where it is absent (CI), the identifier
ranges of its Appendix Q stand in for it."""


def _entry(**fields: object) -> ResultEntry:
    base: dict = {"id": "R-C1", "what": "a result", "paper": "Sec. 2.2", "entry_points": ("events",),
                  "params": "", "report": "Table 6", "status": "produced", "needs": ""}
    base.update(fields)
    return ResultEntry(**base)


def test_the_index_holds_exactly_the_papers_identifiers():
    ids = [e.id for e in load()]
    assert len(ids) == len(set(ids))
    expected = set(expected_ids())
    assert len(expected) == 62
    if PAPER.exists():
        cited = paper_result_ids(PAPER.read_text(encoding="utf-8"))
        assert cited - expected == set(), "the paper cites identifiers outside R-C1..R-C15, R-D0..R-D46"
        expected |= cited
    assert set(ids) - expected == set(), "identifiers the paper does not define"
    assert expected - set(ids) == set(), "identifiers of the paper without an entry"


def test_paper_ids_are_read_from_brackets_and_written_ranges():
    text = "see [R-D17] and [R-C3]; entries [R-C1]–[R-C4] and [R-D0]-[R-D2]; R-D99 unbracketed"
    assert paper_result_ids(text) == {"R-C1", "R-C2", "R-C3", "R-C4", "R-D0", "R-D1", "R-D2", "R-D17"}


def test_every_entry_point_named_exists_in_mlproject():
    mlproject = yaml.safe_load((REPO / "MLproject").read_text(encoding="utf-8"))
    known = set(mlproject["entry_points"])
    for e in load():
        unknown = set(e.entry_points) - known
        assert not unknown, f"{e.id}: no such entry point in MLproject: {sorted(unknown)}"


def test_statuses_are_valid_and_a_gap_is_named():
    entries = load()
    for e in entries:
        assert e.status in STATUSES, e.id
        if e.status == "produced":
            assert e.entry_points and e.report and not e.needs, e.id
        else:
            assert e.needs, e.id
    assert {e.status for e in entries} <= set(STATUSES)


@pytest.mark.parametrize("entries, field", [
    ((_entry(), _entry()), "listed twice"),
    ((_entry(status="done"),), "not one of"),
    ((_entry(status="partial"),), "names what it needs"),
    ((_entry(status="missing", entry_points=(), report=""),), "names what it needs"),
    ((_entry(report=""),), "names its entry points"),
    ((_entry(needs="a GPU"),), "needs nothing"),
    ((_entry(id="R-X1"),), "not a result identifier"),
    ((_entry(id="R-D0"), _entry(id="R-C2")), "identifier order"),
])
def test_validation_refuses_a_bad_index(entries: tuple[ResultEntry, ...], field: str):
    with pytest.raises(MistillInputError, match=field):
        validate(entries)


def test_load_refuses_a_malformed_file(tmp_path: Path):
    raw = yaml.safe_load(DATA_FILE.read_text(encoding="utf-8"))
    del raw["entries"][0]["needs"]
    bad = tmp_path / "index.yaml"
    bad.write_text(yaml.safe_dump(raw), encoding="utf-8")
    with pytest.raises(MistillInputError, match="missing fields"):
        load(bad)
    bad.write_text(yaml.safe_dump({"entries": [dict(raw["entries"][1], entry_points="events")]}),
                   encoding="utf-8")
    with pytest.raises(MistillInputError, match="list of entry point names"):
        load(bad)


def test_the_page_is_the_index_rendered():
    page = render_markdown()
    assert page.splitlines()[0].startswith("Generated from `mistill/results_index.yaml`")
    assert REGENERATE in page.splitlines()[0]
    assert DOC.read_text(encoding="utf-8") == page, f"docs/RESULTS_INDEX.md is stale; regenerate: {REGENERATE}"
    for e in load():
        assert f"| {e.id} |" in page
