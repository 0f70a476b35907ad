"""Trace and note edits (App. E, Tables 21-23): the identity re-feed reproduces the clean margin,
an edit's re-feed equals a fresh forward of the edited input, the mediation read equals
mean-ablation at the decision, edits align token for token or are refused, replacement codes
keep the mention's shape; and the ``trace_edit`` stage end to end on the real tracking server."""

from __future__ import annotations

import pytest
import torch

from mistill.instrument.edits import (aligned_edit, code_shape, filler_candidates, refeed_margins,
                                      replacement_codes, written_like)
from mistill.instrument.hooks import HeadHook
from mistill.instrument.passes import prefill_note
from mistill.instrument.patching import Query, clean_read, margins_from_logits, mean_ablate
from mistill.instrument.runner import Runner
from mistill.models.loading import tiny_model
from model_fixtures import sharpen

CASES = [("qwen3", 2, 4, 2), ("llama", 2, 4, 1), ("smollm3", 4, 4, 2)]
N_POS, Q = 48, 40


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def setup(request):
    family, layers, heads, kv = request.param
    lm = sharpen(tiny_model(family, layers=layers, heads=heads, kv_heads=kv, d_head=16, d_model=64, seed=3))
    runner, hook = Runner(lm, chunk_size=16), HeadHook(lm.geometry)
    ids = torch.randint(0, 2000, (N_POS,), generator=torch.Generator().manual_seed(2))
    prefix, mean = prefill_note(runner, hook, ids)
    q = Query(position=Q, token_id=int(ids[Q]), target_id=301, competitor_ids=(302, 303, 304))
    return lm, runner, hook, ids, prefix, mean, q


@pytest.fixture(scope="module")
def attributed(tracking_uri, tmp_path_factory, pinned_code_version):
    """One tiny attribute run for the edit stages (its root, its id)."""
    from stage_fixtures import tiny_attribute_run

    root = tmp_path_factory.mktemp("edits-root")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MISTILL_ROOT", str(root))
        return root, tiny_attribute_run("edits")


def _fresh_margin(lm, ids: torch.Tensor, q: Query) -> float:
    with torch.no_grad():
        logits = lm.model(ids[None, :q.position + 1]).logits[0, q.position].float()
    return float(margins_from_logits(logits, q.target_id, q.competitor_ids))


def test_identity_refeed_is_the_clean_margin_and_edits_equal_fresh_forwards(setup):
    lm, runner, hook, ids, prefix, mean, q = setup
    start = 17
    edited = [ids.clone() for _ in range(3)]
    edited[0][17:20] = torch.tensor([5, 6, 7])
    edited[1][18] = 1234
    edited[2][21:23] = torch.tensor([99, 98])
    tokens = torch.stack([ids] + edited)[:, start:Q + 1]
    margins, ablated = refeed_margins(runner, hook, prefix, start, tokens, q)
    assert ablated is None
    clean = _fresh_margin(lm, ids, q)
    assert abs(float(margins[0]) - clean) < 1e-4
    assert abs(float(margins[0]) - clean_read(runner, hook, prefix, q).margin) < 1e-5
    for j, e in enumerate(edited, start=1):
        assert abs(float(margins[j]) - _fresh_margin(lm, e, q)) < 1e-4
    assert max(abs(float(margins[j] - margins[0])) for j in range(1, 4)) > 1e-3  # the edits move the margin


def test_variants_batched_or_one_per_forward_agree(setup):
    """The variants of an event are batch elements of one forward; cut into forwards of one
    variant (``max_rows``) they give the same margins, plain and ablated."""
    lm, runner, hook, ids, prefix, mean, q = setup
    g = lm.geometry
    start = 25
    variants = ids[start:Q + 1].repeat(3, 1)
    variants[1, 2] = 1500
    variants[2, 5:7] = torch.tensor([11, 12])
    heads = [g.n_heads + 1]
    together = refeed_margins(runner, hook, prefix, start, variants, q, mean=mean, heads=heads)
    alone = refeed_margins(runner, hook, prefix, start, variants, q, mean=mean, heads=heads, max_rows=1)
    for a, b in zip(together, alone):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0.0)
    assert float((together[0] - together[1]).abs().max()) > 1e-4  # the ablation moves every read
    with pytest.raises(ValueError, match="beyond the prefix"):
        refeed_margins(runner, hook, prefix, N_POS + 1, ids[None, :1], Query(N_POS + 1, 1, 2, (3,)))


def test_mediation_read_is_mean_ablation_at_the_decision(setup):
    lm, runner, hook, ids, prefix, mean, q = setup
    g = lm.geometry
    heads = [g.n_total_heads - 1, g.n_heads]  # one head of the last layer, one of layer 1
    margins, ablated = refeed_margins(runner, hook, prefix, 30, ids[None, 30:Q + 1], q, mean=mean, heads=heads)
    expected = mean_ablate(runner, hook, prefix, q, [heads], mean)
    assert abs(float(ablated[0]) - float(expected[0])) < 1e-5
    assert abs(float(ablated[0]) - float(margins[0])) > 1e-4  # the ablation does something
    with pytest.raises(ValueError, match="query"):
        refeed_margins(runner, hook, prefix, 30, ids[None, 30:Q], q)


def test_aligned_edits_and_their_refusals():
    a = torch.arange(20)
    b = a.clone()
    b[8:10] = torch.tensor([100, 101])
    al = aligned_edit(a, b, [(8, 10)])
    assert al is not None and (al.first, al.last) == (8, 9) and torch.equal(al.input_ids, b)
    assert aligned_edit(a, b, [(9, 10)]) is not None  # one token of slack for a merge at the boundary
    assert aligned_edit(a, b, [(10, 12)]) is None  # a change outside the mention
    assert aligned_edit(a, torch.arange(21), [(8, 10)]) is None  # a token more: later positions shift
    same = aligned_edit(a, a.clone(), [(8, 10)])
    assert same is not None and same.first > same.last


def test_replacement_codes_keep_the_shape_and_the_relation():
    codes = ["N18.9", "N18.6", "N17.0", "N39.0", "K21.0", "K2.1", "E11.9", "N18.30", "I10"]
    assert code_shape("N18.9") == "A99.9" and written_like("N17.0", "N189") == "N170"
    unrelated = replacement_codes("unrelated", "N18.6", "N18.9", "N18.6", codes, seed=0)
    assert sorted(unrelated) == ["E11.9", "K21.0"]
    other = replacement_codes("other_category", "N186", "N18.9", "N18.6", codes, seed=0)
    assert sorted(other) == ["N170", "N390"]  # undotted like the mention, same chapter, another category
    orders = {tuple(replacement_codes("unrelated", "N18.6", "N18.9", "N18.6", codes, seed=s)) for s in range(8)}
    assert len(orders) == 2  # the order is seeded
    with pytest.raises(ValueError):
        replacement_codes("sibling", "N18.6", "N18.9", "N18.6", codes, seed=0)
    fillers = filler_candidates(5)
    assert fillers[0] == "-" and all(not any(ch.isalnum() and ch != "x" for ch in f) for f in fillers)


def test_trace_edit_stage_end_to_end(attributed, tmp_path, monkeypatch):
    """events -> attribute -> trace_edit on a tiny model against the real tracking server: every
    edited event has the identity re-feed at the clean margin, aligned replacements, Table 21 with
    the three replacements and the paired rows, and a rerun is reused."""
    import json

    import numpy as np
    import pandas as pd
    from mlflow.tracking import MlflowClient

    from mistill.stages.edits import REPLACEMENTS, TraceEditConfig, run_trace_edit
    from stage_fixtures import finished_note_rows

    root, attribute = attributed
    monkeypatch.setenv("MISTILL_ROOT", str(root))
    cfg = TraceEditConfig(attribute_run=attribute, max_events=3)
    run_id = run_trace_edit(cfg)
    client = MlflowClient()
    df = pd.DataFrame(finished_note_rows(root, run_id, "trace_edit", "trace_edit.jsonl"))
    assert 0 < len(df) <= 3 * 3
    assert float((df["identity"] - df["clean"]).abs().max()) < 1e-4
    assert df["neutral"].notna().all()  # a filler of the same token length is always found here
    assert df["unrelated"].notna().any() and df["other_category"].notna().any()
    assert np.isfinite(df["identity_ablated"]).all()
    for kind in ("unrelated", "other_category"):
        got = df[df[kind].notna()]
        assert all(t and not t.startswith(("-", "x")) for t in got[f"{kind}_text"])
    table = pd.read_csv(client.download_artifacts(run_id, "trace_edit.csv", str(tmp_path / "t")))
    assert list(table["comparison"]) == [*REPLACEMENTS, "neutral_minus_unrelated", "neutral_minus_other_category"]
    neutral = table.set_index("comparison").loc["neutral"]
    assert neutral["n_events"] == len(df)
    assert neutral["effect_mean"] == pytest.approx(float((df["identity"] - df["neutral"]).mean()), abs=1e-6)
    med = json.loads(client.download_artifacts(run_id, "trace_edit_mediation.json", str(tmp_path / "m"))
                     and (tmp_path / "m" / "trace_edit_mediation.json").read_text())
    assert len(med["mediation_heads"]) == 2
    assert run_trace_edit(cfg) == run_id


def test_words_and_spans():
    from mistill.instrument.edits import content_words, replace_spans, word_spans

    assert content_words("Chronic kidney disease, stage 5 of the other type") == {"chronic", "kidney", "disease",
                                                                                "stage"}
    text = "xx Kidney kidneys kidney. kidney"
    assert word_spans(text, "kidney", (0, len(text))) == [(3, 9), (18, 24), (26, 32)]
    assert word_spans(text, "kidney", (4, 30)) == [(18, 24)]  # whole occurrences inside the region only
    assert replace_spans(text, [((18, 24), "--"), ((3, 9), "=")]) == "xx = kidneys --. kidney"
    with pytest.raises(ValueError, match="overlapping"):
        replace_spans(text, [((3, 9), "a"), ((5, 7), "b")])


def test_description_word_sets():
    from mistill.data.inventory import Inventory
    from mistill.stages.edits import DescriptionWords

    inv = Inventory.billable(codes=["N18.5", "N18.6", "N17.0", "E11.9", "I10"])
    words = DescriptionWords.of(inv)
    own, sib = words.by_code["N18.5"], words.by_code["N18.6"]
    note = own | sib | words.by_code["E11.9"] | words.by_code["I10"] | {"ambulating", "afebrile", "tolerated"}
    sets = words.word_sets("N18.5", "N18.6", note, seed=0)
    assert set(sets["code_words"]) == (own - sib) and set(sets["sibling_words"]) == (sib - own)
    k = len(sets["code_words"])
    chapter_n = words.by_chapter["N"]
    if "other_chapter_words" in sets:
        assert len(sets["other_chapter_words"]) == k and not set(sets["other_chapter_words"]) & chapter_n
    assert len(sets["no_description_words"]) == k
    assert set(sets["no_description_words"]) <= {"ambulating", "afebrile", "tolerated"}
    assert sets == words.word_sets("N18.5", "N18.6", note, seed=0)  # seeded
    assert "code_words" not in words.word_sets("N18.5", "N18.6", {"ambulating"}, seed=0)


def test_note_edit_stage_end_to_end(attributed, tmp_path, monkeypatch):
    """events -> attribute -> note_edit on a tiny model against the real tracking server: every
    qualifying event has the identity re-feed at the clean margin and its variants' words counted
    (never their text: the rows hold no string but the event id), Table 23 is logged, and a rerun is
    reused."""
    import pandas as pd
    from mlflow.tracking import MlflowClient

    from mistill.stages.edits import NOTE_VARIANTS, NoteEditConfig, run_note_edit
    from stage_fixtures import finished_note_rows

    root, attribute = attributed
    monkeypatch.setenv("MISTILL_ROOT", str(root))
    cfg = NoteEditConfig(attribute_run=attribute, max_events=4)
    run_id = run_note_edit(cfg)
    client = MlflowClient()
    run = client.get_run(run_id)
    rows = finished_note_rows(root, run_id, "note_edit", "note_edit.jsonl")
    df = pd.DataFrame(rows)
    q = df[df["qualifies"]]
    assert len(q) > 0 and (q["code_words_words"] > 0).all()
    assert float((q["identity"] - q["clean"]).abs().max()) < 1e-4
    assert q["code_words"].notna().any()
    assert all(isinstance(v, (int, float, bool)) or v is None for r in rows for k, v in r.items() if k != "event_id")
    table = pd.read_csv(client.download_artifacts(run_id, "note_edit.csv", str(tmp_path / "t")))
    assert list(table["comparison"])[:4] == list(NOTE_VARIANTS)
    assert table.set_index("comparison").loc["code_words", "n_events"] == int(q["code_words"].notna().sum())
    assert run.data.metrics["note_edit/n_qualifying"] == len(q)
    assert run_note_edit(cfg) == run_id


def test_refeed_leaves_the_prefix_as_it_was(setup):
    lm, runner, hook, ids, prefix, mean, q = setup
    keys = [k.clone() for k in prefix.keys]
    values = [v.clone() for v in prefix.values]
    length, written = prefix.length, prefix.written
    edited = ids.clone()
    edited[20:23] = torch.tensor([7, 8, 9])
    refeed_margins(runner, hook, prefix, 20, torch.stack([ids, edited])[:, 20:Q + 1], q, mean=mean, heads=[1])
    assert (prefix.length, prefix.written) == (length, written)
    assert all(torch.equal(a, b) for a, b in zip(keys, prefix.keys))
    assert all(torch.equal(a, b) for a, b in zip(values, prefix.values))
