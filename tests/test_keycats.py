"""The read side's 15 key categories on the real SmolLM2 prompt: each token in exactly one, each
category holding the text it names, and a real head's attention row splitting into shares that
sum to one."""

from __future__ import annotations

import numpy as np
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

    tok = embedded_tokenizer()
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


def test_read_measures_on_a_hand_built_row():
    """Two heads over 10 keys: 4 region tokens (own line 2, chapter lines 2), 4 other inventory
    tokens, 2 prose tokens; the row sits at key 9."""
    from mistill.instrument.keycats import read_measures

    names = ["own_line", "own_line", "chapter_lines", "chapter_lines", "other_chapter_lines",
             "other_chapter_lines", "inventory_other", "inventory_other", "prose", "prose"]
    cats = torch.tensor([KEY_CATEGORIES.index(n) for n in names])
    rows = torch.tensor([[0.2, 0.2, 0.1, 0.1, 0.05, 0.05, 0.05, 0.05, 0.1, 0.1],   # reads the region
                         [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5]])  # reads prose only
    m = read_measures(rows, cats, 9)
    torch.testing.assert_close(torch.from_numpy(m["shares"]).sum(-1), torch.ones(2, dtype=torch.float64))
    assert m["shares"][0, KEY_CATEGORIES.index("own_line")] == pytest.approx(0.4)
    # region share of inventory attention 0.6 / 0.8 = 0.75, region's token share 4 / 8 = 0.5
    assert m["region_lift"][0] == pytest.approx(1.5)
    p = torch.tensor([0.2, 0.2, 0.1, 0.1, 0.05, 0.05, 0.05, 0.05]) / 0.8
    assert m["n_eff"][0] == pytest.approx(float(1 / (p ** 2).sum()))
    assert np.isnan(m["region_lift"][1]) and np.isnan(m["n_eff"][1])  # nothing on the inventory
    # keys after the row carry no mass
    assert read_measures(rows, cats, 7)["shares"][1].sum() == 0.0


def test_read_side_stage_end_to_end(tracking_uri, tmp_path, monkeypatch, pinned_code_version):
    """events -> attribute -> read_side on a tiny model against the real tracking server: the
    panel logged by group, per-note shares that sum to one at every event and head, importance
    read from the attribute run, Tables 16-19 with a family per head, the read-back's per-note N
    shares recomputed from the notes' shares, and an identical rerun reused."""
    import json
    from pathlib import Path

    from mlflow.tracking import MlflowClient

    from mistill.stages.readside import FAMILIES, ReadSideConfig, run_read_side
    from stage_fixtures import tiny_attribute_run

    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path))
    attribute = tiny_attribute_run("read")
    cfg = ReadSideConfig(attribute_run=attribute, panel_top=3, panel_bottom=2, panel_random=2)
    run_id = run_read_side(cfg)
    client = MlflowClient()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["mistill.stage"] == "read_side"
    panel = json.loads(Path(client.download_artifacts(run_id, "readside_panel.json", str(tmp_path / "p"))).read_text())
    assert {"top_P1", "bottom_P1", "random"} <= set(panel) and len(panel["top_P1"]) == 3
    assert set(panel["top_P1"]) <= set(panel["panel"])
    n_notes, readback = 0, {}
    col = {name: j for j, name in enumerate(panel["panel"])}
    for d in sorted((tmp_path / "work" / run_id / "notes").iterdir()):
        with np.load(d / "readside.npz") as z:
            shares, kinds, imp = z["shares"], z["kinds"], z["importance"]
        assert shares.shape[1] == len(panel["panel"]) and shares.shape[2] == len(KEY_CATEGORIES)
        np.testing.assert_allclose(shares.sum(-1), 1.0, atol=1e-5)
        assert set(kinds) <= {"P1", "P2", "P2C"} and np.isfinite(imp).all()
        n_notes += 1
        p2c = kinds == "P2C"
        for group, key in (("top", "top_P2C"), ("random", "random"), ("bottom", "bottom_P2C")):
            if p2c.any():  # the read-back: the group's mean share on N over the note's P2C events
                cells = shares[p2c][:, [col[h] for h in panel[key]], KEY_CATEGORIES.index("N")]
                readback[(d.name, group)] = float(cells.mean())
    assert n_notes == 3 and readback
    logged = _table(client, run_id, "readside_readback_notes", tmp_path)
    got = {(str(r.note_id), r.group): r.n_share for r in logged.itertuples()}
    assert got.keys() == readback.keys()
    assert all(abs(got[k] - v) < 1e-9 for k, v in readback.items())
    groups = _table(client, run_id, "readside_groups", tmp_path)
    assert "P1" in set(groups["phase"]) and groups["n_notes"].max() <= 3
    heads = _table(client, run_id, "readside_heads_P1", tmp_path)
    assert list(heads["head"]) == panel["top_P1"] and set(heads["family"]) <= set(FAMILIES)
    assert heads["share_region"].between(0, 1).all()
    assert "readside/P1/lift_top" in run.data.metrics
    assert run_read_side(cfg) == run_id  # an identical finished run is reused


def _table(client, run_id: str, name: str, tmp_path):
    import pandas as pd

    return pd.read_csv(client.download_artifacts(run_id, f"{name}.csv", str(tmp_path / name)))
