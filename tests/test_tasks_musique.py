"""MuSiQue-Ans: the release's JSONL, answer-emission events, the answer line and the scores."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mistill.errors import MistillInputError
from mistill.instrument.events import extract_events
from mistill.tasks import task
from mistill.tasks.musique import load_musique


def _question(qid: str, **over):
    row = {"id": qid, "question": "Which city hosts the museum of the painter of the Wall mural?",
           "paragraphs": [{"idx": 0, "title": "Paris", "paragraph_text": "Paris is a city.", "is_supporting": True},
                          {"idx": 1, "title": "Paraguay", "paragraph_text": "A country.", "is_supporting": False},
                          {"idx": 2, "title": "Berlin Wall", "paragraph_text": "A wall.", "is_supporting": True},
                          {"idx": 3, "title": "Parma", "paragraph_text": "A city.", "is_supporting": False}],
           "answer": "Paris", "answer_aliases": ["City of Paris"], "answerable": True}
    row.update(over)
    return row


def _write(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_loader_and_candidate_inventory(tmp_path):
    qs = load_musique(_write(tmp_path / "musique_ans_v1.0_dev.jsonl",
                             [_question("2hop__1"), _question("2hop__2", answer_aliases=None, answerable=None)]))
    q = qs[0]
    assert q.id == "2hop__1" and [p.title for p in q.paragraphs][:2] == ["Paris", "Paraguay"]
    assert q.paragraphs[2].is_supporting and q.gold == ("Paris", "City of Paris")
    assert q.candidates == {"Paris": "title of passage 0", "Paraguay": "title of passage 1",
                            "Berlin Wall": "title of passage 2", "Parma": "title of passage 3",
                            "City of Paris": "an answer alias"}
    assert qs[1].aliases == () and qs[1].answerable


@pytest.mark.parametrize("over, field", [
    ({"paragraphs": [{"idx": 0, "paragraph_text": "x", "is_supporting": True}]}, "paragraphs[0].title"),
    ({"paragraphs": "Paris"}, "paragraphs"),
    ({"answerable": "yes"}, "answerable"),
    ({"answer_aliases": ["ok", 3]}, "answer_aliases"),
    ({"question": ""}, "question"),
])
def test_loader_errors_name_file_record_and_field(tmp_path, over, field):
    path = _write(tmp_path / "q.jsonl", [_question("2hop__1"), _question("3hop__9", **over)])
    with pytest.raises(MistillInputError) as exc:
        load_musique(path)
    e = exc.value
    assert (e.file, e.line, e.note, e.field) == (str(path), 2, "3hop__9", field)
    assert "3hop__9" in str(e) and str(path) in str(e)


def test_answer_emission_events_by_hand():
    q = _question("2hop__1")
    cands = list(load_musique_like(q).candidates)
    t = task("musique")
    trace = "<think>\nThe wall is the Berlin Wall; the painter lived in Paris.\n</think>\n\nAnswer: Paris."
    ev = extract_events(q["id"], trace, cands, task=t, n_null=0)
    a = trace.rindex("Paris")
    # trie over the candidates: 'P' against the other first letters B (Berlin Wall), C (City of
    # Paris); after "Par", 'i' against 'a' (Paraguay) and 'm' (Parma); nothing else branches
    assert [(e.kind, e.code, e.anchor, e.target, e.competitors, e.char_index) for e in ev] == [
        ("P2", "Paris", a, "P", ("B", "C"), 0),
        ("P2", "Paris", a + 3, "i", ("a", "m"), 3),
    ]
    # an emitted answer that is no candidate is still scored where it shares a prefix with them
    other = trace.replace("Answer: Paris.", "Answer: Parisian")
    assert [(e.code, e.target, e.competitors) for e in extract_events("x", other, cands, task=t, n_null=0)] == [
        ("Parisian", "P", ("B", "C")), ("Parisian", "i", ("a", "m"))]
    # no event in the reasoning, none for an abstention, none without the answer part
    assert extract_events("x", trace.replace("Answer: Paris.", "Answer: unanswerable"), cands, task=t) == []
    assert extract_events("x", trace, cands, task=t, n_null=0, include_answer=False) == []


def load_musique_like(row):
    from mistill.tasks.musique import MuSiQueQuestion, Paragraph

    return MuSiQueQuestion(id=row["id"], question=row["question"], answer=row["answer"],
                           aliases=tuple(row["answer_aliases"]), answerable=True,
                           paragraphs=tuple(Paragraph(p["idx"], p["title"], p["paragraph_text"], p["is_supporting"])
                                            for p in row["paragraphs"]))


def test_parser_and_official_scores():
    t = task("musique")
    assert t.parse_answer("<think>x</think>\nSo.\n**Answer:** \"Paris\".") == ("Paris",)
    assert t.parse_answer("<think>x</think>\nThe answer is below\nParis") == ("Paris",)
    assert t.parse_answer("<think>x</think>\nAnswer: Unknown") == ()
    assert t.parse_answer("<think>never closed\nAnswer: Paris") == ()
    gold = ("Paris", "City of Paris")
    assert t.metric(gold, ("the Paris",)) == {"em": 1.0, "f1": 1.0}
    m = t.metric(gold, ("Paris, France",))
    assert m["em"] == 0.0 and m["f1"] == pytest.approx(2 / 3)
    assert t.metric(gold, ()) == {"em": 0.0, "f1": 0.0}
