"""The embedded synthetic parts catalogue: a second label space through the task interface.

Hand-derived events on a hand-written trace; the generated corpus through the demo pipeline's
steps (prepared data written and read back, prompts, extraction, realization on the embedded
SmolLM2 tokenizer, attribution on a tiny model with that tokenizer)."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pytest

from mistill.data.corpus import Corpus
from mistill.data.inventory import Inventory
from mistill.errors import MistillInputError
from mistill.instrument.events import extract_events, realize_events
from mistill.tasks import TASK_NAMES, task
from mistill.tasks.synthetic_catalog import CatalogTask, make_catalog_corpus, make_catalog_inventory

ITEMS = {"KIT-204": "Brass repair kit", "KIT-207": "Nylon repair kit", "KIT-315": "Steel repair kit",
         "PMP-517": "Cast iron pump", "PMP-520": "Copper pump", "VLV-100": "Ball valve"}


def span(text: str, needle: str, nth: int = 0) -> tuple[int, int]:
    s = [m.start() for m in re.finditer(re.escape(needle), text)][nth]
    return s, s + len(needle)


def rows(events):
    return [(e.kind, e.code, e.anchor, e.target, e.competitors, e.near_miss, e.S, e.N) for e in events]


def test_registry_names_every_task():
    assert set(TASK_NAMES) == {"icd10", "musique", "eurlex57k", "bigcodebench", "catalog"}
    assert task("catalog").name == "catalog" and task("catalog").has_p1
    with pytest.raises(MistillInputError) as exc:
        task("imagenet")
    assert exc.value.field == "task"


def test_hand_trace_events_exactly():
    trace = ("<think>\nThe order points to the K family. Options KIT-204 and KIT-207. Not KIT-207; "
             "PMP-517 too.\n</think>\n\n[\"KIT-204\", \"PMP-517\"]")
    t = CatalogTask(Inventory(codes=tuple(ITEMS), descriptions=ITEMS))
    ev = extract_events("c1", trace, list(ITEMS), task=t, n_null=0)
    m1, m2, m3 = span(trace, "KIT-204"), span(trace, "KIT-207"), span(trace, "KIT-207", 1)
    m4, m5 = span(trace, "PMP-517"), span(trace, "KIT-204", 1)
    assert rows(ev) == [
        ("P1", "KIT-204", m1[0], "K", ("P", "V"), None, (), ()),
        ("P2", "KIT-204", m1[0] + 4, "2", ("3",), None, (), ()),
        ("P2", "KIT-204", m1[0] + 6, "4", ("7",), None, (), ()),
        ("P1", "KIT-207", m2[0], "K", ("P", "V"), None, (), ()),
        ("P2", "KIT-207", m2[0] + 4, "2", ("3",), None, (), ()),
        ("P2", "KIT-207", m2[0] + 6, "7", ("4",), None, (), ()),
        ("P2C", "KIT-207", m2[0] + 6, "7", ("4",), "KIT-204", (), (m1,)),
        ("P2C", "KIT-207", m3[0] + 6, "7", ("4",), "KIT-204", (m2,), (m1,)),
        ("P1", "PMP-517", m4[0], "P", ("K", "V"), None, (), ()),
        ("P2", "PMP-517", m4[0] + 5, "1", ("2",), None, (), ()),
        ("P2C", "KIT-204", m5[0] + 6, "4", ("7",), "KIT-207", (m1,), (m2, m3)),
    ]
    assert all(trace[e.anchor] == e.target for e in ev)
    # the ICD-10-CM adapter (the default) refuses this label space instead of misreading it
    with pytest.raises(MistillInputError):
        extract_events("c1", trace, list(ITEMS), n_null=0)
    # answer and metric
    assert t.parse_answer(trace) == ("KIT-204", "PMP-517")
    assert t.metric(["KIT-204", "VLV-100"], t.parse_answer(trace))["f1"] == pytest.approx(0.5)
    text = "KIT-2041 KIT-204-B xKIT-204 KIT-204."
    assert t.find_mentions(text, list(ITEMS)) == [("KIT-204", text.rindex("KIT"), len(text) - 1)]


def test_generated_corpus_is_deterministic_and_codes_like_the_clinical_one():
    a, b = make_catalog_corpus(4, seed=3), make_catalog_corpus(4, seed=3)
    assert a.digest == b.digest and a.inventory == b.inventory
    assert make_catalog_corpus(4, seed=4).digest != a.digest
    inv = a.inventory
    assert all(inv.category(c) == c.split("-")[0] for c in inv.codes)  # family = category
    assert len(set(inv.letters)) == len(inv.categories())  # one letter per family: P1 = family
    t = CatalogTask(inv)
    for note in a.notes:
        assert t.parse_answer(note.teacher_trace) == note.gold_codes
        kinds = Counter(e.kind for e in extract_events(note.note_id, note.teacher_trace, inv.codes, task=t))
        assert kinds["P1"] and kinds["P2"] and kinds["P2C"] and kinds["NULL"]


@pytest.fixture(scope="module")
def tokenizer():
    from mistill.models.loading import embedded_tokenizer

    return embedded_tokenizer()


def test_pipeline_steps_on_the_catalogue(tmp_path, tokenizer):
    """prepare (written and read back as the stage stores it) -> events (extract + realize on
    SmolLM2's tokenizer) -> attribute (first-order and exact passes on a tiny model)."""
    from mistill.instrument.hooks import HeadHook
    from mistill.instrument.passes import AttributionConfig, attribute_note
    from mistill.instrument.runner import Runner
    from mistill.models.loading import tiny_model
    from mistill.stages.characterize import event_queries
    from mistill.stages.common import CORPUS_FILE, INVENTORY_FILE, Prepared, prepared_note_input, save_prepared

    corpus = make_catalog_corpus(2, seed=0, inventory=make_catalog_inventory(0, n_families=6))
    save_prepared(tmp_path, corpus, {"remove_discharge_diagnosis": True, "narrow_instruction": True},
                  run_id="local")
    inv = Inventory.from_json(tmp_path / INVENTORY_FILE)
    back = Corpus.from_jsonl(tmp_path / CORPUS_FILE, name="catalog", privacy="synthetic", inventory=inv)
    assert back.digest == corpus.digest
    prepared = Prepared(corpus=back, inventory=inv, data_dir=tmp_path, run_id="local")
    t = task("catalog", inventory=inv)
    note = back.notes[0]
    ni = prepared_note_input(prepared, note, tokenizer)
    assert note.discharge_diagnosis not in ni.full_text  # the parts list is removed like a diagnosis section
    events = extract_events(note.note_id, ni.trace, inv.codes, tokenizer=tokenizer, task=t, n_null=6)
    drops: Counter = Counter()
    realized = realize_events(events, full_text=ni.full_text, trace_offset=ni.trace_offset, tokenizer=tokenizer,
                              input_ids=ni.input_ids.tolist(), offsets=ni.offsets, codes=list(inv.codes),
                              task=t, drops=drops)
    kinds = Counter(r.event.kind for r in realized)
    assert kinds["P2"] and kinds["P2C"] and kinds["NULL"] == 6 and kinds["P1"]
    ids = ni.input_ids.tolist()
    for r in realized:
        if r.event.kind != "NULL":  # the decided token is the model's next token
            assert ids[r.position + 1] == r.target_id
            assert r.chunk.startswith(r.event.target)
        if r.event.kind == "P2C":
            assert r.N_positions and all(p < r.position for p in r.N_positions)
    # the digit after the dash is its own SmolLM2 token: every P2 / P2C survives realization
    assert sum(n for (k, _), n in drops.items() if k in ("P2", "P2C")) == 0

    lm = tiny_model("qwen3", layers=2, heads=2, kv_heads=1, d_head=8, d_model=16, seed=0, tokenizer=tokenizer)
    picked = [r for r in realized if r.event.kind in ("P1", "P2C", "NULL")][:6]
    queries = event_queries(picked, ni.input_ids)
    cfg = AttributionConfig(top_nominees=2, global_nominees=1, exact_kinds=("P1",), chunk_size=256,
                            selftest_events=0, grad_batch=3)
    g = lm.geometry
    att = attribute_note(Runner(lm, chunk_size=256), HeadHook(g), note.note_id, ni.input_ids, queries, cfg,
                         running_global=[0], progress=False)
    assert att.first_order.shape == (len(queries), g.n_total_heads)
    assert np.isfinite(att.importance).all() and np.isfinite(att.margins).all()
