"""The direct-path effect of every head and the faithfulness of ``c`` to exact importance (Sec. 2.3).

``direct_effects`` against the distillation objective's own ``contribution`` (two implementations
of one quantity), the captured final residual against the model's logits, and the readout's
correlations, pooling and magnitude on hand-made attributions with known values."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mistill.distill.attention_rows import contribution
from mistill.instrument import faithfulness
from mistill.instrument.attribution import direct_effects, first_order
from mistill.instrument.hooks import HeadHook
from mistill.instrument.passes import AttributionConfig, EventQuery, NoteAttribution, attribute_note, prefill_note
from mistill.instrument.patching import Query
from mistill.instrument.runner import Runner
from mistill.models.loading import tiny_model


@pytest.fixture(scope="module")
def lm():
    return tiny_model("qwen3", layers=3, heads=4, kv_heads=2, d_head=16, d_model=64, seed=9)


def _query(ids: torch.Tensor, position: int) -> Query:
    return Query(position=position, token_id=int(ids[position]), target_id=301,
                 competitor_ids=(302, 303, 304, 305))


def test_direct_effects_are_the_objectives_one_head_contribution_times_the_margin(lm):
    g = lm.geometry
    runner, hook = Runner(lm, chunk_size=64), HeadHook(g)
    ids = torch.randint(0, 2000, (80,), generator=torch.Generator().manual_seed(1))
    prefix, mean = prefill_note(runner, hook, ids)
    q = _query(ids, 70)
    prefix.crop(q.position)
    fo = first_order(runner, hook, prefix, q, mean)
    # the captured final residual is what the logits were computed from
    logits = g.lm_head(g.final_norm(fo.final_hidden.unsqueeze(0)))[0].float()
    assert torch.allclose(logits, fo.logits, atol=1e-4, rtol=1e-4)
    direct = direct_effects(g, fo.z.unsqueeze(0), fo.final_hidden.unsqueeze(0), fo.logits.unsqueeze(0), [q])[0]
    assert direct.shape == (g.n_total_heads,) and torch.isfinite(direct).all()
    # several events in one call (the pass's groups) give each event its own row
    q2 = Query(position=q.position, token_id=q.token_id, target_id=302, competitor_ids=(301, 303))
    pair = direct_effects(g, fo.z.expand(2, *fo.z.shape), fo.final_hidden.expand(2, -1), fo.logits.expand(2, -1),
                          [q, q2])
    alone = direct_effects(g, fo.z.unsqueeze(0), fo.final_hidden.unsqueeze(0), fo.logits.unsqueeze(0), [q2])[0]
    assert torch.allclose(pair[0], direct, rtol=1e-5, atol=1e-6) and torch.allclose(pair[1], alone, rtol=1e-5, atol=1e-6)
    comp = list(q.competitor_ids)
    for h in (0, 5, g.n_total_heads - 1):
        layer, head = divmod(h, g.n_heads)
        c = contribution({layer: fo.z[layer, [head]].unsqueeze(0)}, {layer: [head]}, {layer: [1.0]}, g,
                         fo.final_hidden.unsqueeze(0), [q.target_id], [comp], [fo.logits[comp]],
                         torch.tensor([fo.margin]))
        # float32 sums in two orders: agreement to a few ulps of the margin's scale
        assert float(c[0]) * fo.margin == pytest.approx(float(direct[h]), rel=1e-4, abs=1e-5)


def test_attribution_pass_records_the_direct_effects(lm):
    g = lm.geometry
    ids = torch.randint(0, 2000, (120,), generator=torch.Generator().manual_seed(2))
    events = [EventQuery(event_id=f"n:{k}:{i}", kind=k, target=str(i), char_index=0, query=_query(ids, p))
              for i, (k, p) in enumerate([("P1", 110), ("P2C", 100), ("P2C", 90)])]
    cfg = AttributionConfig(top_nominees=6, global_nominees=0, p2c_top_nominees=6, p2c_global_nominees=0,
                            chunk_size=64)
    att = attribute_note(Runner(lm, chunk_size=64), HeadHook(g), "n", ids, events, cfg, progress=False)
    assert att.direct.shape == att.first_order.shape
    assert set(att.arrays()) >= {"direct", "exact", "first_order"}
    rows = faithfulness.event_rows([att], "P2C")
    assert [r["event_id"] for r in rows] == ["n:P2C:1", "n:P2C:2"] and {r["n_heads"] for r in rows} == {6}
    for r in rows:
        assert all(-1.0 - 1e-9 <= r[f"{q}.spearman"] <= 1.0 + 1e-9 for q in faithfulness.QUANTITIES
                   if np.isfinite(r[f"{q}.spearman"]))


def _att(note: str, exact: np.ndarray, direct: np.ndarray, first_order: np.ndarray, margins, kinds) -> NoteAttribution:
    n = exact.shape[0]
    return NoteAttribution(note_id=note, event_ids=[f"{note}:{i}" for i in range(n)], kinds=list(kinds),
                           positions=np.arange(n), margins=np.asarray(margins, dtype=np.float32),
                           first_order=first_order.astype(np.float32), exact=exact.astype(np.float32),
                           direct=direct.astype(np.float32))


def test_readout_on_hand_made_attributions():
    nan = np.nan
    # note a: event 0 (P2C) patched heads 0-3; direct = 0.25 * exact (so c = exact / 8 with margin 2);
    # event 1 (P2C) has two patched heads only (left out); event 2 is P1 (left out)
    exact_a = np.array([[1.0, 2.0, 3.0, 4.0, nan], [1.0, 2.0, nan, nan, nan], [1.0, 2.0, 3.0, 4.0, 5.0]])
    fo_a = np.array([[4.0, 3.0, 2.0, 1.0, 0.0], [0.0] * 5, [0.0] * 5])
    att_a = _att("a", exact_a, 0.25 * np.nan_to_num(exact_a), fo_a, [2.0, 1.0, 1.0], ["P2C", "P2C", "P1"])
    # note b: one P2C event, heads 1-4 patched, a negative margin (c's sign flips, m c's does not)
    exact_b = np.array([[nan, 1.0, 3.0, 2.0, 4.0]])
    att_b = _att("b", exact_b, 0.5 * np.nan_to_num(exact_b), np.nan_to_num(exact_b), [-1.0], ["P2C"])
    rows = faithfulness.event_rows([att_a, att_b], "P2C")
    assert [(r["note_id"], r["event_id"], r["n_heads"]) for r in rows] == [("a", "a:0", 4), ("b", "b:0", 4)]
    a, b = rows
    assert a["c.spearman"] == pytest.approx(1.0) and a["mc.pearson"] == pytest.approx(1.0)
    assert a["first_order.spearman"] == pytest.approx(-1.0)
    assert b["c.spearman"] == pytest.approx(-1.0) and b["mc.spearman"] == pytest.approx(1.0)
    assert (a["mc_over_exact"], b["mc_over_exact"]) == (pytest.approx(0.25), pytest.approx(0.5))
    pooled = faithfulness.pooled([att_a, att_b], "P2C")
    # per head, the mean over the events that patched it: head 0 (a only) ... head 4 (b only)
    mean_exact = np.array([1.0, 1.5, 3.0, 3.0, 4.0])
    mean_mc = np.array([0.25, (0.5 + 0.5) / 2, (0.75 + 1.5) / 2, (1.0 + 1.0) / 2, 2.0])
    assert pooled["n_heads"] == 5
    assert pooled["mc.pearson"] == pytest.approx(float(np.corrcoef(mean_mc, mean_exact)[0, 1]))
    out = faithfulness.summary(rows, pooled)
    assert out["n_events"] == 2 and out["mc_over_exact"] == pytest.approx(0.375)
    assert out["c/spearman"] == pytest.approx(0.0)  # the median of +1 and -1
    assert out["mc/pearson_pooled"] == pytest.approx(pooled["mc.pearson"])
    # an attribution written before the direct effects were recorded gives no rows
    old = _att("c", exact_b, exact_b, exact_b, [1.0], ["P2C"])
    old.direct = None
    assert faithfulness.event_rows([old]) == [] and faithfulness.pooled([old])["n_heads"] == 0


# ------------------------------------------------------------------------ the attribute stage
def test_attribute_stage_logs_the_readouts(tracking_uri, tmp_path, monkeypatch, pinned_code_version):
    """The attribute run logs c's faithfulness at the P2C events it patched exactly, and the
    first-order ranking against the exact-refined one: where a phase gets no exact patch
    (``exact_p2=False`` for P2) the two rankings are one ranking."""
    from mlflow.tracking import MlflowClient
    from stage_fixtures import TINY, TINY_HEADS, unique

    from mistill.stages.characterize import AttributeConfig, EventsConfig, run_attribute, run_events
    from mistill.stages.prepare import PrepareConfig, run_prepare

    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path))
    prep = run_prepare(PrepareConfig(corpus="synthetic", corpus_name=unique("faith"), n_notes=3, model=TINY))
    events = run_events(EventsConfig(prepare_run=prep, model=TINY, n_null=4))
    client = MlflowClient()
    intact = client.get_run(run_attribute(AttributeConfig(events_run=events, stability_splits=5)))
    metrics = intact.data.metrics
    assert metrics["faithfulness/n_events"] > 0 and metrics["faithfulness/n_heads_pooled"] <= TINY_HEADS
    for q in faithfulness.QUANTITIES:
        assert -1.0 - 1e-9 <= metrics[f"faithfulness/{q}/spearman"] <= 1.0 + 1e-9
    assert metrics["faithfulness/mc_over_exact"] > 0
    assert -1.0 - 1e-9 <= metrics["refinement/P1/spearman"] <= 1.0 + 1e-9
    plain = client.get_run(run_attribute(AttributeConfig(events_run=events, stability_splits=5, exact_p2=False)))
    m = plain.data.metrics
    assert m["refinement/P2/spearman"] == pytest.approx(1.0)
    assert m["refinement/P2/top_overlap/8"] == m["refinement/P2/top_overlap/40"] == TINY_HEADS
    assert "faithfulness/n_events" not in m  # no P2C event was patched exactly
    import pandas as pd

    top8 = pd.read_csv(client.download_artifacts(plain.info.run_id, "top8_exact.csv", str(tmp_path / "dl")))
    p2 = top8[top8["phase"] == "P2"]
    assert len(p2) == 8 and (p2["n_events_patched"] == 0).all() and list(p2["rank"]) == list(p2["rank_first_order"])
