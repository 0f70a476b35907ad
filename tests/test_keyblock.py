"""Key-side blocking on tiny random models (GQA, q/k norms, rotary and a NoPE layer): the
recomputed row is eager attention's, an empty key set reproduces the clean read, blocking every
key but the sink puts all mass on it, and named keys move the margin."""

from __future__ import annotations

import pytest
import torch

from mistill.instrument.hooks import HeadHook
from mistill.instrument.keyblock import blocked_attention, head_replaced, key_block
from mistill.instrument.passes import prefill_note
from mistill.instrument.patching import Query, clean_read
from mistill.instrument.runner import Runner
from mistill.models.loading import tiny_model
from model_fixtures import sharpen

CASES = [("qwen3", 2, 4, 2), ("llama", 2, 4, 1), ("smollm3", 4, 4, 2)]
N_POS = 48
POS = 40


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def setup(request):
    family, layers, heads, kv = request.param
    lm = sharpen(tiny_model(family, layers=layers, heads=heads, kv_heads=kv, d_head=16, d_model=64, seed=5,
                            attn_implementation="eager"))
    runner, hook = Runner(lm, chunk_size=16), HeadHook(lm.geometry)
    ids = torch.randint(0, 2000, (N_POS,), generator=torch.Generator().manual_seed(1))
    prefix, _ = prefill_note(runner, hook, ids)
    prefix.crop(POS)
    q = Query(position=POS, token_id=int(ids[POS]), target_id=301, competitor_ids=(302, 303, 304))
    clean = clean_read(runner, hook, prefix, q)
    return lm, runner, hook, ids, prefix, q, clean


def test_rows_equal_eager_attention_and_the_clean_output(setup):
    lm, runner, hook, ids, prefix, q, clean = setup
    g = lm.geometry
    with torch.no_grad():
        eager = lm.model(ids[None, :POS + 1], output_attentions=True).attentions
    for head in range(g.n_total_heads):
        layer, h = divmod(head, g.n_heads)
        probs, z = blocked_attention(runner, prefix, q, clean.hidden_in, head, [[]])
        torch.testing.assert_close(probs[0], eager[layer][0, h, POS], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(z[0], clean.z[layer, h].float(), atol=1e-5, rtol=1e-4)
    assert float(probs[0].max()) * (POS + 1) > 2.0  # far from uniform: the comparison has teeth


def test_empty_set_is_the_clean_read_and_blocking_all_but_the_sink(setup):
    lm, runner, hook, ids, prefix, q, clean = setup
    g = lm.geometry
    head = g.n_total_heads - 2
    layer, h = divmod(head, g.n_heads)
    everything_but_sink = list(range(1, POS + 1))
    probs, z = blocked_attention(runner, prefix, q, clean.hidden_in, head, [[], everything_but_sink])
    assert float(probs[1, 0]) == 1.0 and float(probs[1, 1:].abs().max()) == 0.0
    kv = h // g.n_groups
    torch.testing.assert_close(z[1], prefix.values[layer][0, kv, 0].float(), atol=0.0, rtol=0.0)
    margins = key_block(runner, hook, prefix, q, clean.hidden_in, head, [[], everything_but_sink, [0, 5, 6]])
    assert abs(float(margins[0]) - clean.margin) < 1e-5  # the reference path reproduces the clean margin
    moved = [abs(float(margins[i] - margins[0])) for i in range(1, 3)]
    assert max(moved) > 1e-4  # blocking keys moves the decision
    # the reference runs in the same forward as the blocked sets: a repeat gives the same bits
    again = key_block(runner, hook, prefix, q, clean.hidden_in, head, [[], everything_but_sink, [0, 5, 6]])
    assert torch.equal(again, margins)


def test_the_masked_path_leaves_every_other_head_and_layer_unchanged(setup):
    """Bit for bit: the blocked head's replacement is the only change. Given its own clean output
    the path returns the clean margin, and with an empty key set the layer's other heads are the
    clean forward's."""
    lm, runner, hook, ids, prefix, q, clean = setup
    g = lm.geometry
    for head in (0, g.n_total_heads - 1):
        layer, h = divmod(head, g.n_heads)
        same = head_replaced(runner, hook, prefix, q, clean.hidden_in, head, clean.z[layer, h][None])
        assert float(same[0]) == clean.margin
        with hook.record([0]) as rec:
            key_block(runner, hook, prefix, q, clean.hidden_in, head, [[]])
        others = [i for i in range(g.n_heads) if i != h]
        assert torch.equal(rec.per_layer[layer][0, others], clean.z[layer, others])
        assert set(rec.per_layer) == set(range(layer, g.n_layers))  # the layers below are not re-run


def test_invalid_key_sets_are_refused(setup):
    lm, runner, hook, ids, prefix, q, clean = setup
    with pytest.raises(ValueError, match="every key"):
        blocked_attention(runner, prefix, q, clean.hidden_in, 0, [list(range(POS + 1))])
    with pytest.raises(ValueError, match=r"\[0, 40\]"):
        blocked_attention(runner, prefix, q, clean.hidden_in, 0, [[POS + 1]])


def test_named_keys_and_matched_controls_by_whole_units():
    from mistill.instrument.keyblock import KEY_SETS, matched_control, named_keys
    from mistill.instrument.keycats import KEY_CATEGORIES

    c = {name: i for i, name in enumerate(KEY_CATEGORIES)}
    # keys 0-1 sink, two other-chapter lines (buckets 7, 8), the region's line, trace with mentions
    cats = torch.tensor([c["sink"], c["sink"], c["other_chapter_lines"], c["other_chapter_lines"],
                         c["other_chapter_lines"], c["own_line"], c["chapter_lines"], c["other_chapter_lines"],
                         c["prose"], c["other_mentions"], c["other_mentions"], c["prose"], c["N"], c["N"],
                         c["prose"], c["other_mentions"], c["prose"], c["N"]])
    base = torch.tensor([0, 0, 7, 7, 7, 9, 10, 8, 20, 20, 20, 20, 20, 20, 20, 20, 20, 20])
    region, n = KEY_SETS["region"], KEY_SETS["N"]
    assert named_keys(cats, 16, region) == [5, 6]
    assert named_keys(cats, 16, n) == [12, 13]  # key 17 lies after the query
    for seed in range(6):
        ctrl = matched_control(cats, base, 16, region, 2, seed)
        # whole lines in a seeded order, the last cut to the count: line 8 then line 7, or line 7 alone
        assert all(int(cats[p]) == c["other_chapter_lines"] for p in ctrl) and len(ctrl) == 2
        assert set(ctrl) in ({2, 3}, {2, 4}, {3, 4}, {2, 7}, {3, 7}, {4, 7}) and (7 in ctrl) == (ctrl != [2, 3])
        m = matched_control(cats, base, 16, n, 2, seed)
        assert m in ([9, 10], [9, 15], [10, 15])  # mentions: runs of consecutive tokens
    assert matched_control(cats, base, 16, region, 2, 3) == matched_control(cats, base, 16, region, 2, 3)
    assert matched_control(cats, base, 16, region, 5, 0) is None  # four control keys before the query
    assert matched_control(cats, base, 16, n, 0, 0) == []


def test_key_block_table_by_hand():
    import numpy as np
    import pandas as pd

    from mistill.stages.keyblock import key_block_table

    rows = pd.DataFrame([
        {"note_id": "a", "head": "L1H0", "key_set": "N", "E": 1.0, "D_named": 0.9, "D_control": 0.1,
         "clean": 2.0, "reference": 2.0},
        {"note_id": "a", "head": "L1H0", "key_set": "N", "E": 0.05, "D_named": 0.5, "D_control": None,
         "clean": 1.0, "reference": 1.01},
        {"note_id": "b", "head": "L1H0", "key_set": "N", "E": 2.0, "D_named": 1.0, "D_control": 0.0,
         "clean": 3.0, "reference": 3.0},
    ])
    t = key_block_table(rows, [("L1H0", "N"), ("L0H0", "region")], 0.1).set_index(["head", "key_set"])
    r = t.loc[("L1H0", "N")]
    assert r["n_events"] == 3 and r["n_notes"] == 2 and r["n_control_unmatched"] == 1
    assert r["share_named"] == pytest.approx(np.median([0.9, 0.5]))  # E above 0.1 only
    assert r["share_control"] == pytest.approx(np.median([0.1, 0.0]))
    assert r["named_minus_control"] == pytest.approx(np.mean([0.8, 1.0]))  # per note, then over notes
    assert r["notes_higher"] == 2 and r["notes_lower"] == 0
    assert r["E_share_above"] == pytest.approx(2 / 3)
    assert t.loc[("L0H0", "region")]["n_events"] == 0


def test_key_block_stage_end_to_end(tracking_uri, tmp_path, monkeypatch, pinned_code_version):
    """events -> attribute -> read_side -> key_block on a tiny model against the real tracking
    server: the reference reproduces the clean margin, every named set is blocked at the phases it
    belongs to with a control of the same size, Table 20 is logged, the heads chosen from the read
    side are the P2C top-k's largest readers of the near-miss's mentions, and a rerun is reused."""
    import json

    import numpy as np
    import pandas as pd
    from mlflow.tracking import MlflowClient

    from mistill.instrument.keycats import KEY_CATEGORIES
    from mistill.stages.common import RunReader
    from mistill.stages.keyblock import KeyBlockConfig, chosen_heads, run_key_block
    from mistill.stages.readside import ReadSideConfig, run_read_side
    from stage_fixtures import finished_note_rows, tiny_attribute_run

    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path))
    attribute = tiny_attribute_run("kb")
    read_side = run_read_side(ReadSideConfig(attribute_run=attribute, panel_top=3, panel_bottom=0, panel_random=2))
    cfg = KeyBlockConfig(read_side_run=read_side, heads="L1H2:region+S,L1H3:N+near_miss_line", max_events=4)
    run_id = run_key_block(cfg)
    client = MlflowClient()
    df = pd.DataFrame(finished_note_rows(tmp_path, run_id, "key_block", "key_block.jsonl"))
    assert set(df["key_set"]) >= {"region", "N"}
    assert set(df.loc[df["key_set"] == "region", "kind"]) == {"P1"}
    assert set(df.loc[df["key_set"].isin(["N", "near_miss_line"]), "kind"]) == {"P2C"}
    assert df.groupby(["head", "key_set", "kind"]).size().max() <= 3 * 4  # max_events per note and phase
    assert float((df["reference"] - df["clean"]).abs().max()) < 1e-4  # the empty set reproduces the clean read
    assert (df["n_keys"] > 0).all() and np.isfinite(df["E"]).all() and (df["D_named"].abs() > 0).any()
    table = pd.read_csv(client.download_artifacts(run_id, "key_block.csv", str(tmp_path / "t")))
    assert list(zip(table["head"], table["key_set"])) == [("L1H2", "region"), ("L1H2", "S"), ("L1H3", "N"),
                                                          ("L1H3", "near_miss_line")]
    assert table.loc[table["key_set"] == "N", "n_events"].iloc[0] == (df["key_set"] == "N").sum()
    assert run_key_block(cfg) == run_id  # an identical finished run is reused
    # heads chosen from the read side: the P2C top-k ordered by their median share on N
    rs = RunReader(read_side)
    panel = json.loads(rs.file("readside_panel.json").read_text())
    chosen = chosen_heads(rs, sorted(p.name for p in (tmp_path / "work" / read_side / "notes").iterdir()),
                          KeyBlockConfig(read_side_run=read_side, region_heads=0, loopback_heads=1))
    col, n_cat, per_note = {h: j for j, h in enumerate(panel["panel"])}, KEY_CATEGORIES.index("N"), []
    for d in sorted((tmp_path / "work" / read_side / "notes").iterdir()):
        with np.load(d / "readside.npz") as z:
            ev = z["kinds"] == "P2C"
            if ev.any():
                per_note.append([z["shares"][ev][:, col[h], n_cat].mean() for h in panel["top_P2C"]])
    best = panel["top_P2C"][int(np.argmax(np.median(per_note, axis=0)))]
    assert chosen == [(best, "N"), (best, "near_miss_line")]


def test_rows_read_off_the_prefix_equal_eager_attention(setup):
    """The read side's capture (queries from one forward of the events' rows, keys from the
    prefix) gives eager attention's rows for every head, NoPE layers included."""
    from mistill.instrument.readside import head_attention_rows, prefix_attention_rows

    lm, runner, hook, ids, prefix, q, clean = setup
    g = lm.geometry
    positions = [5, 17, 33, 39]
    heads = list(range(g.n_total_heads))[::-1]  # any order
    rows = prefix_attention_rows(runner, prefix, positions, heads)
    with torch.no_grad():
        eager = lm.model(ids[None], output_attentions=True).attentions
    assert rows.shape == (len(positions), len(heads), N_POS)
    for j, head in enumerate(heads):
        layer, h = divmod(head, g.n_heads)
        torch.testing.assert_close(rows[:, j], eager[layer][0, h, positions], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(rows, head_attention_rows(lm, ids, positions, heads), atol=1e-6, rtol=1e-5)
    assert float(rows.max()) > 0.5  # sharp rows: the comparison has teeth
