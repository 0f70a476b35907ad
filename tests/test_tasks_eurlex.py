"""EURLEX57K: the release's document and concept files, a local hierarchy, concept-naming events."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from mistill.errors import MistillInputError
from mistill.instrument.events import extract_events
from mistill.tasks import task
from mistill.tasks.eurlex import (label_words, lexical_ranking, load_broader, load_eurlex_documents, load_eurovoc,
                                  micro_f1)

CONCEPTS = {"100": {"label": "public health", "alt_labels": []}, "101": {"label": "health policy"},
            "102": {"label": "health care"}, "103": {"label": "public order"}, "104": {"label": "health"}}
BROADER = {"100": ["104"], "101": ["104"], "102": ["104"]}


def _doc(celex: str, **over):
    row = {"celex_id": celex, "uri": f"http://example.invalid/{celex}", "type": "Regulation",
           "title": "Commission Regulation on health care", "header": "THE COMMISSION,",
           "recitals": "Whereas: (1) health matters.", "main_body": ["Article 1", "Article 2"],
           "attachments": "Done at Brussels.", "concepts": ["100", "101"]}
    row.update(over)
    return row


@pytest.fixture
def release(tmp_path: Path):
    docs = tmp_path / "dataset" / "dev"
    docs.mkdir(parents=True)
    for celex, over in (("32010R0001", {}), ("32010R0002", {"concepts": [102]})):
        (docs / f"{celex}.json").write_text(json.dumps(_doc(celex, **over)))
    (tmp_path / "EURLEX57K.json").write_text(json.dumps(CONCEPTS))
    (tmp_path / "broader.json").write_text(json.dumps(BROADER))
    return tmp_path


def test_loaders(release):
    acts = load_eurlex_documents(release / "dataset")
    assert [a.celex_id for a in acts] == ["32010R0001", "32010R0002"]
    assert acts[1].concepts == ("102",) and acts[0].main_body == ("Article 1", "Article 2")
    assert acts[0].text.startswith("Commission Regulation on health care\n\nTHE COMMISSION,")
    concepts = load_eurovoc(release / "EURLEX57K.json")
    assert concepts["100"] == "public health"
    broader = load_broader(release / "broader.json", concepts)
    t = task("eurlex57k", concepts=concepts, broader=broader)
    assert t.gold(acts[0]) == ("public health", "health policy")
    assert t.items["health care"] == "EuroVoc 102"
    # relation: siblings (one broader concept), broader / narrower, nothing else
    assert t.related("health care", "public health") and t.related("health", "health care")
    assert t.related("health care", "health") and not t.related("public order", "public health")


@pytest.mark.parametrize("over, field", [({"concepts": None}, "concepts"), ({"main_body": "Article 1"}, "main_body"),
                                         ({"title": 3}, "title"), ({"concepts": ["100", {}]}, "concepts")])
def test_document_errors_name_file_record_and_field(release, over, field):
    bad = release / "dataset" / "dev" / "32010R0003.json"
    bad.write_text(json.dumps(_doc("32010R0003", **over)))
    with pytest.raises(MistillInputError) as exc:
        load_eurlex_documents(release / "dataset")
    assert (exc.value.file, exc.value.note, exc.value.field) == (str(bad), "32010R0003", field)


def test_concept_and_hierarchy_errors(release):
    (release / "EURLEX57K.json").write_text(json.dumps({**CONCEPTS, "105": {"alt_labels": []}}))
    with pytest.raises(MistillInputError) as exc:
        load_eurovoc(release / "EURLEX57K.json")
    assert (exc.value.note, exc.value.field) == ("105", "label")
    concepts = {k: v["label"] for k, v in CONCEPTS.items()}
    (release / "broader.json").write_text(json.dumps({"100": ["999"]}))
    with pytest.raises(MistillInputError) as exc:
        load_broader(release / "broader.json", concepts)
    assert (exc.value.file, exc.value.note, exc.value.field) == (str(release / "broader.json"), "100", "broader")
    t = task("eurlex57k", concepts=concepts)
    act = load_eurlex_documents(release / "dataset")[0]
    with pytest.raises(MistillInputError) as exc:
        task("eurlex57k", concepts={"100": "public health"}).gold(act)
    assert (exc.value.note, exc.value.field) == ("32010R0001", "concepts")
    assert not t.related("health care", "public health")  # no hierarchy: no relation


def test_concept_naming_events_by_hand():
    concepts = {k: v["label"] for k, v in CONCEPTS.items()}
    t = task("eurlex57k", concepts=concepts, broader=BROADER)
    trace = ("<think>\nThe act concerns Public health and health care. Not health policy.\n</think>\n\n"
             "[\"public health\", \"102\"]")
    ev = extract_events("32010R0001", trace, list(concepts.values()), task=t, n_null=0)

    def at(needle, nth=0):
        return [m.start() for m in re.finditer(re.escape(needle), trace, re.IGNORECASE)][nth]

    m1, m2, m3, m4 = at("public health"), at("health care"), at("health policy"), at("public health", 1)
    s1, s2, s3 = (m1, m1 + 13), (m2, m2 + 11), (m3, m3 + 13)
    assert [(e.kind, e.code, e.anchor, e.target, e.competitors, e.near_miss, e.S, e.N) for e in ev] == [
        # "Public health": the capital P differs from the label, so the naming is scored only
        # from "ublic health" on; after "public " the trie branches 'h' / 'o' (public order)
        ("P2", "public health", m1 + 7, "h", ("o",), None, (), ()),
        ("P2", "health care", m2, "h", ("p",), None, (), ()),
        ("P2C", "health care", m2, "h", ("p",), "public health", (), (s1,)),
        ("P2", "health care", m2 + 7, "c", ("p",), None, (), ()),
        ("P2", "health policy", m3, "h", ("p",), None, (), ()),
        ("P2C", "health policy", m3, "h", ("p",), "public health", (), (s1,)),
        ("P2", "health policy", m3 + 7, "p", ("c",), None, (), ()),
        ("P2C", "health policy", m3 + 7, "p", ("c",), "health care", (), (s2,)),
        ("P2C", "public health", m4, "p", ("h",), "health care", (s1,), (s2,)),
        ("P2C", "public health", m4, "p", ("h",), "health policy", (s1,), (s3,)),
    ]
    assert all(trace[e.anchor] == e.target for e in ev)


def test_parser_and_micro_f1():
    concepts = {k: v["label"] for k, v in CONCEPTS.items()}
    t = task("eurlex57k", concepts=concepts)
    gen = '<think>x</think>\n["Public Health", 102, "102", "no such concept", 7]'
    assert t.parse_answer(gen) == ("public health", "health care")
    assert t.parse_answer('<think>["health"]') == ()
    rows = [t.metric(("public health", "health policy"), t.parse_answer(gen)),
            t.metric(("health",), ("health",))]
    assert rows[0]["f1"] == 0.5 and rows[1]["f1"] == 1.0
    assert micro_f1(rows) == pytest.approx(2 * 2 / (2 * 2 + 1 + 1))


def test_retrieval_ranking_by_hand():
    # a label's score is the share of its words' idf the act holds; ties go to the larger mass
    # found, then to the label; a word without an idf counts 1, duplicates keep their first place
    idf = {"public": 2.0, "health": 1.0, "order": 3.0, "policy": 2.5}
    text = "Rules on Public Health and on health care."
    ranked = lexical_ranking(text, ["public order", "health care", "health", "public health", "health policy",
                                    "health"], idf)
    # shares: public health 3/3, health care 2/2 ("care" counts 1), health 1/1, public order 2/5,
    # health policy 1/3.5
    assert ranked == ("public health", "health care", "health", "public order", "health policy")
    assert lexical_ranking(text, ["health", "health care"], {}) == ("health care", "health")
    assert lexical_ranking("health", ["b health", "a health"], {}) == ("a health", "b health")  # equal: the label
    assert label_words("EU-wide aid, 2010 (Art. 3)") == {"eu", "wide", "aid", "art"}
    # the task's idf comes from the concept file's labels: "health", held by four of five, counts
    # less than "public" (two) and "order" (one)
    concepts = {k: v["label"] for k, v in CONCEPTS.items()}
    t = task("eurlex57k", concepts=concepts)
    assert t.retrieval_ranking("on public order", ["health", "public health", "public order"]) == \
        ("public order", "public health", "health")
    assert t.retrieval_ranking("on public order", []) == ()
    assert task("musique").retrieval_ranking("on public order", ["public order"]) is None


def test_the_stages_parse_answers_as_the_task_reads_them():
    # evaluate, generate, flip_test and the LAS simulator parse through the task's answer index:
    # labels in any case and ids (strings or JSON numbers) count, over the prepared inventory only
    from mistill.evaluation.parsing import CodeIndex, parse_answer

    concepts = {k: v["label"] for k, v in CONCEPTS.items()}
    t = task("eurlex57k", concepts=concepts)
    index = t.answer_index(("public health", "health care", "health"))  # "health policy" not prepared
    gen = '<think>x</think>\n["Public Health", 102, "102", "health policy", "no such concept", 7, true]'
    answer = parse_answer(gen, index)
    assert answer.codes == ("public health", "health care")
    assert (answer.n_out_of_inventory, answer.n_malformed) == (3, 1)  # the bool is no id
    assert parse_answer(gen, t.answer_index(concepts.values())).codes == t.parse_answer(gen)
    default = parse_answer('<think>x</think>["Public Health", 102]', CodeIndex(["public health", "health care"]))
    assert default.codes == () and (default.n_out_of_inventory, default.n_malformed) == (1, 1)  # codes as written
