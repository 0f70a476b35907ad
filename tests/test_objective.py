"""The Mistill objective end to end on tiny models: teacher targets, student pairing, terms."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mistill.data.synthetic import make_synthetic_corpus
from mistill.distill.arms import resolve_arm
from mistill.distill.note_data import build_note_data
from mistill.distill.objective import compute_note_targets, micro_step_loss, pair_rows
from mistill.distill.pools import model_pools
from mistill.instrument.calibration import NoteImportance, calibrate, head_sets_json
from mistill.instrument.events import extract_events
from mistill.models.loading import tiny_model


def _head_sets(lm, seed):
    rng = np.random.default_rng(seed)
    notes = []
    for i in range(6):
        kinds = np.array(["P1"] * 4 + ["P2"] * 4 + ["P2C"] * 4 + ["NULL"] * 6)
        notes.append(NoteImportance(note_id=f"n{i}", patient_id=f"p{i}", kinds=kinds,
                                    importance=rng.normal(size=(kinds.size, lm.geometry.n_total_heads)).astype(np.float32)))
    return head_sets_json(calibrate(notes, seed=0), lm.geometry.head_names())


@pytest.fixture(scope="module")
def setup():
    corpus = make_synthetic_corpus(n_notes=1, seed=4)
    note = corpus.notes[0]
    teacher = tiny_model("qwen3", layers=3, heads=4, kv_heads=2, d_head=16, d_model=64, seed=1)
    events = extract_events(note.note_id, note.teacher_trace, list(corpus.inventory.codes),
                            tokenizer=teacher.tokenizer, n_null=4)
    nd_t = build_note_data(note, corpus.inventory, teacher.tokenizer, events)
    pools_t = model_pools(_head_sets(teacher, 0), teacher.geometry.head_names(), k=5)
    targets = compute_note_targets(teacher, nd_t, pools_t, window=8)
    return corpus, note, teacher, events, nd_t, pools_t, targets


def test_terms_vanish_when_student_is_teacher(setup):
    corpus, note, teacher, events, nd_t, pools_t, targets = setup
    nd_s = build_note_data(note, corpus.inventory, teacher.tokenizer, events)
    pairing = pair_rows(nd_s, nd_t.realized.values(), targets, window=8, teacher_trace_start=nd_t.trace_start)
    assert len(pairing.rows) == len(targets["rows_pos"])  # same tokenizer: every row pairs
    arm = resolve_arm("mistill")
    with torch.no_grad():
        loss, parts = micro_step_loss(teacher.model, teacher, nd_s, targets, pairing, pools_t, arm)
    # two phases, P2C inside Phase 2: no term of its own, only the per-kind diagnostics
    assert not any(k.startswith("P2C/") for k in parts)
    for name in ("P1/attention", "P2/attention", "P2/attention/P2", "P2/attention/P2C"):
        assert parts[name] == pytest.approx(0.0, abs=1e-5)
    for name in ("P1/interaction", "P2/interaction", "P2/interaction/P2", "P2/interaction/P2C"):
        assert parts[name] == pytest.approx(0.0, abs=1e-6)
    assert parts["loss"] == pytest.approx(parts["ce"] + parts["kl"], abs=1e-5)


def _kl_rows(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """``KL(p || q)`` per row over the buckets where ``p > 0``, in float64."""
    p, q = p.astype(np.float64), q.astype(np.float64)
    on = p > 0
    return np.where(on, p * (np.log(np.where(on, p, 1.0)) - np.log(np.where(on, q, 1.0))), 0.0).sum(1)


def test_phase_two_is_one_mean_over_its_p2_and_p2c_rows(setup):
    """Phase 2 = P2 with P2C (Sec. 2.2), one weight lambda_P2 (App. I.3): each Phase-2 term is one
    mean over the union of the P2 and P2C rows (events), weighted once. The teacher stands in for
    the student, so the student's rows, m and c are the stored ones (previous test); the targets
    of the Phase-2 rows are then moved by a known, kind-dependent amount and the expected terms
    computed here from the stored arrays alone."""
    corpus, note, teacher, events, nd_t, pools_t, targets = setup
    kind_of = {e: r.event.kind for e, r in nd_t.realized.items()}
    row_kind = np.array([kind_of[e] for e in targets["row_event_id"]])
    ev_kind = np.array([kind_of[e] for e in targets["event_id"]])
    n_p2, n_p2c = int((row_kind == "P2").sum()), int((row_kind == "P2C").sum())
    assert n_p2 > 0 and n_p2c > 0 and n_p2 != n_p2c  # unequal counts: a union mean is not a mean of means

    # attention: each Phase-2 teacher row reweighted within its support, harder at P2C rows
    rng = np.random.default_rng(0)
    moved = {k: np.asarray(v).copy() for k, v in targets.items()}
    pooled = targets["pooled"].astype(np.float64)
    for kind, spread in (("P2", 0.3), ("P2C", 1.5)):
        rows = row_kind == kind
        p = pooled[rows] * np.exp(spread * rng.standard_normal(pooled[rows].shape))
        moved["pooled"][rows] = (p / p.sum(1, keepdims=True)).astype(targets["pooled"].dtype)
    kl = _kl_rows(moved["pooled"], pooled)  # the student's rows are the stored teacher rows
    want_attn = {k: kl[row_kind == k].mean() for k in ("P2", "P2C")}
    want_attn["phase"] = kl[(row_kind == "P2") | (row_kind == "P2C")].mean()

    # interaction: the teacher's c moved by a kind-dependent offset, so m_T c_T moves by m * offset
    offset = np.where(ev_kind == "P2", 1.0, np.where(ev_kind == "P2C", 5.0, 0.0))
    moved["c"] = (targets["c"] + offset).astype(targets["c"].dtype)
    kept = np.isfinite(targets["margin"]) & (targets["margin"] != 0) & np.isfinite(targets["c"])
    sq = (targets["m"].astype(np.float64) * offset) ** 2
    want_int = {k: sq[kept & (ev_kind == k)].mean() for k in ("P2", "P2C")}
    want_int["phase"] = sq[kept & ((ev_kind == "P2") | (ev_kind == "P2C"))].mean()

    # the fixture separates the readings: the union mean is neither one kind's mean nor their sum
    for want in (want_attn, want_int):
        assert abs(want["phase"] - want["P2"]) > 0.1 * want["phase"]
        assert abs(want["phase"] - (want["P2"] + want["P2C"])) > 0.1 * want["phase"]
        assert abs(want["phase"] - (want["P2"] + want["P2C"]) / 2) > 0.05 * want["phase"]

    nd_s = build_note_data(note, corpus.inventory, teacher.tokenizer, events)
    pairing = pair_rows(nd_s, nd_t.realized.values(), moved, window=8, teacher_trace_start=nd_t.trace_start)
    arm = resolve_arm("mistill", "min_abs_margin=0,lambda_p1=0.1,lambda_p2=0.3")
    with torch.no_grad():
        loss, parts = micro_step_loss(teacher.model, teacher, nd_s, moved, pairing, pools_t, arm)
    assert parts["P2/attention"] == pytest.approx(want_attn["phase"], rel=1e-3)
    assert parts["P2/interaction"] == pytest.approx(want_int["phase"], rel=1e-3)
    for kind in ("P2", "P2C"):  # the per-kind diagnostics
        assert parts[f"P2/attention/{kind}"] == pytest.approx(want_attn[kind], rel=1e-3)
        assert parts[f"P2/interaction/{kind}"] == pytest.approx(want_int[kind], rel=1e-3)
    # weighted once by lambda_P2; the diagnostics and P2C add nothing; Phase 1 is untouched
    assert parts["P2/weighted"] == pytest.approx(0.3 * (want_attn["phase"] + want_int["phase"]), rel=1e-3)
    assert not any(k.startswith("P2C/") for k in parts)
    assert parts["P1/attention"] == pytest.approx(0.0, abs=1e-5)
    assert parts["loss"] == pytest.approx(parts["ce"] + parts["kl"] + parts["P1/weighted"] + parts["P2/weighted"],
                                          rel=1e-5)
    assert float(loss) == pytest.approx(parts["loss"])


def test_student_terms_are_positive_and_train_the_pool(setup):
    corpus, note, teacher, events, nd_t, pools_t, targets = setup
    student = tiny_model("qwen3", layers=2, heads=4, kv_heads=2, d_head=16, d_model=64, seed=2)
    nd_s = build_note_data(note, corpus.inventory, student.tokenizer, events)
    pairing = pair_rows(nd_s, nd_t.realized.values(), targets, window=8, teacher_trace_start=nd_t.trace_start)
    pools_s = model_pools(_head_sets(student, 1), student.geometry.head_names(), k=4)
    student.model.requires_grad_(True)
    loss, parts = micro_step_loss(student.model, student, nd_s, targets, pairing, pools_s, resolve_arm("mistill"))
    assert parts["P2/attention"] > 0 and parts["P2/attention/P2C"] > 0 and parts["loss"] > parts["ce"]
    loss.backward()
    layer = pools_s["P2C"].layers[0]
    assert student.geometry.layers[layer].q_proj.weight.grad.abs().sum() > 0
    # the vanilla arm ignores every term: its loss is the CoT loss alone
    student.model.zero_grad()
    v_loss, v_parts = micro_step_loss(student.model, student, nd_s, targets, pairing, pools_s,
                                      resolve_arm("vanilla-bf16"))
    assert "P1/attention" not in v_parts and v_parts["loss"] == pytest.approx(v_parts["ce"] + v_parts["kl"], rel=1e-5)


def test_targets_are_distributions(setup):
    *_, targets = setup
    assert np.allclose(targets["pooled"].sum(1), 1.0, atol=1e-4)
    assert targets["top_ids"].shape[1] == 32 and np.isfinite(targets["c"]).all()
    assert set(targets["row_role"]) == {"event", "window"}


def test_checkpointed_pooled_rows_match_plain(setup):
    from mistill.distill.attention_rows import LayerInputs
    from mistill.distill.objective import pooled_rows

    corpus, note, teacher, events, nd_t, pools_t, targets = setup
    student = tiny_model("qwen3", layers=2, heads=4, kv_heads=2, d_head=16, d_model=64, seed=3)
    student.model.requires_grad_(True)
    nd = build_note_data(note, corpus.inventory, student.tokenizer, events)
    pool = model_pools(_head_sets(student, 2), student.geometry.head_names(), k=4)["P2"]
    ids = [eid for eid, r in nd.realized.items() if r.event.kind == "P2"][:5]
    maps = torch.stack([nd.row_map(e) for e in ids])
    grads = []
    for ckpt in (True, False):
        student.model.zero_grad()
        with LayerInputs(student.geometry, pool.layers) as kept:
            student.model.model(input_ids=nd.input_ids[None])
            hidden = {l: kept[l][0] for l in pool.layers}
            a, (z, _, _) = pooled_rows(hidden, pool, student, [nd.realized[e].position for e in ids], maps,
                                       nd.axis.n, with_outputs=True, checkpointed=ckpt)
            (a.pow(2).sum() + sum(v.sum() for v in z.values())).backward()
        grads.append(student.geometry.layers[pool.layers[0]].q_proj.weight.grad.clone())
        assert torch.allclose(a.sum(1), torch.ones(len(ids)), atol=1e-5)
    torch.testing.assert_close(grads[0], grads[1])


def test_cross_tokenizer_student_trains_with_uld_and_drops_unrealizable_events(setup):
    from tok_fixtures import merging_tokenizer

    from mistill.distill.objective import align_trace_rows

    corpus, note, teacher, events, nd_t, pools_t, targets = setup
    tok = merging_tokenizer(("18", "28", "65", "95", "11"))
    tok.chat_template = teacher.tokenizer.chat_template  # same prompt layout, another vocabulary
    student = tiny_model("llama", layers=2, heads=4, kv_heads=2, d_head=16, d_model=64, seed=5, tokenizer=tok)
    nd_s = build_note_data(note, corpus.inventory, tok, events)
    # digit runs merged into one token cannot decide one character: those events are dropped
    assert set(nd_s.realized) < set(nd_t.realized)
    assert {nd_t.realized[e].event.kind for e in set(nd_t.realized) - set(nd_s.realized)} <= {"P2", "P2C"}
    pairing = pair_rows(nd_s, nd_t.realized.values(), targets, window=8, teacher_trace_start=nd_t.trace_start)
    assert 0 < len(pairing.rows) < len(targets["rows_pos"])
    t_pos = align_trace_rows(nd_s, nd_t)
    assert len(t_pos) == nd_s.input_ids.numel() - nd_s.trace_start and t_pos.max() < len(targets["top_ids"])
    pools_s = model_pools(_head_sets(student, 3), student.geometry.head_names(), k=4)
    student.model.requires_grad_(True)
    loss, parts = micro_step_loss(student.model, student, nd_s, targets, pairing, pools_s, resolve_arm("mistill"),
                                  kl_mode="uld", teacher_positions=t_pos)
    assert "uld" in parts and np.isfinite(parts["loss"]) and parts["P1/attention"] > 0
    loss.backward()
    assert student.geometry.embed.weight.grad.abs().sum() > 0


def test_uld_alignment_modes(setup):
    """``char_offset``: the teacher row holding the student token's first character (the identity
    under one tokenizer); ``index``: row ``j`` reads teacher row ``j`` (clipped to the trace)."""
    from tok_fixtures import merging_tokenizer

    from mistill.distill.objective import align_trace_rows

    corpus, note, teacher, events, nd_t, pools_t, targets = setup
    n_t = nd_t.input_ids.numel() - nd_t.trace_start
    assert np.array_equal(align_trace_rows(nd_t, nd_t), np.arange(n_t))
    assert np.array_equal(align_trace_rows(nd_t, nd_t, "index"), np.arange(n_t))
    tok = merging_tokenizer(("18", "28", "65", "95", "11"))
    tok.chat_template = teacher.tokenizer.chat_template
    nd_s = build_note_data(note, corpus.inventory, tok, events)
    n_s = nd_s.input_ids.numel() - nd_s.trace_start
    by_index = align_trace_rows(nd_s, nd_t, "index")
    assert np.array_equal(by_index, np.minimum(np.arange(n_s), n_t - 1))
    by_char = align_trace_rows(nd_s, nd_t)
    assert not np.array_equal(by_char, by_index) and np.all(np.diff(by_char) >= 0)


def test_feature_kd_step_with_the_online_teacher(setup):
    from mistill.distill.losses import make_adapter, uniform_layer_pairs
    from mistill.distill.objective import FeatureKD, feature_kd_step

    corpus, note, teacher, events, nd_t, pools_t, targets = setup
    teacher = tiny_model("qwen3", layers=6, heads=4, kv_heads=2, d_head=16, d_model=64, seed=1)
    student = tiny_model("qwen3", layers=4, heads=4, kv_heads=2, d_head=16, d_model=48, seed=6)
    student.model.requires_grad_(True)
    nd_s = build_note_data(note, corpus.inventory, student.tokenizer, events)
    fkd = FeatureKD(teacher=teacher, pairs=uniform_layer_pairs(4, 6), adapter=make_adapter(48, 64, seed=0))
    assert fkd.pairs[-1] == (3, 5)  # the last layers always pair
    loss, parts = feature_kd_step(student.model, student, nd_s, nd_t, targets, fkd, resolve_arm("feature-kd"),
                                  seed=0)
    assert parts["feature_kd/attn"] > 0 and parts["feature_kd/hidden"] > 0
    assert parts["loss"] == pytest.approx(parts["ce"] + parts["kl"] + parts["feature_kd/attn"]
                                          + parts["feature_kd/hidden"], rel=1e-4)
    loss.backward()
    assert fkd.adapter.weight.grad.abs().sum() > 0
    again, parts2 = feature_kd_step(student.model, student, nd_s, nd_t, targets, fkd, resolve_arm("feature-kd"),
                                    seed=0)
    assert parts2["feature_kd/attn"] == pytest.approx(parts["feature_kd/attn"])  # positions fixed by the seed


def test_distillm2_step_prefers_the_teacher_trace(setup):
    from mistill.distill.objective import distillm2_step
    from mistill.evaluation.generation import DecodingConfig, generate_hf

    corpus, note, teacher, events, nd_t, pools_t, targets = setup
    student = tiny_model("qwen3", layers=2, heads=4, kv_heads=2, d_head=16, d_model=64, seed=9)
    nd_s = build_note_data(note, corpus.inventory, student.tokenizer, events)
    own = generate_hf(student, nd_s.inp.prompt.text, DecodingConfig(max_new_tokens=16), seed=1)
    student.model.requires_grad_(True)
    loss, parts = distillm2_step(student.model, student, teacher, nd_s, own.token_ids)
    assert parts["distillm2/skl"] > 0 and parts["distillm2/srkl"] > 0
    assert parts["distillm2/n_dispref"] == 16
    loss.backward()
    assert student.geometry.lm_head.weight.grad.abs().sum() > 0
    # the teacher against itself: both divergences vanish
    same, p2 = distillm2_step(teacher.model, teacher, teacher, nd_t, own.token_ids)
    assert p2["distillm2/skl"] < 1e-6 and p2["distillm2/srkl"] < 1e-6


def test_row_sets_together_equal_one_set_at_a_time(setup):
    from mistill.distill.attention_rows import LayerInputs
    from mistill.distill.objective import RowSet, pooled_row_sets, pooled_rows

    corpus, note, teacher, events, nd_t, pools_t, targets = setup
    student = tiny_model("qwen3", layers=3, heads=4, kv_heads=2, d_head=16, d_model=64, seed=4)
    student.model.requires_grad_(True)
    nd = build_note_data(note, corpus.inventory, student.tokenizer, events)
    pools = model_pools(_head_sets(student, 5), student.geometry.head_names(), k=5)
    sets = []
    for phase in ("P1", "P2", "P2C"):
        ids = [e for e, r in nd.realized.items() if r.event.kind == phase][:4]
        sets.append(RowSet(pools[phase], [nd.realized[e].position for e in ids],
                           torch.stack([nd.row_map(e) for e in ids]), with_outputs=phase != "P1"))
    layers = sorted({l for s in sets for l in s.pool.layers})
    results, grads = [], []
    for together in (True, False):
        student.model.zero_grad()
        with LayerInputs(student.geometry, layers) as kept:
            student.model.model(input_ids=nd.input_ids[None])
            hidden = {l: kept[l][0] for l in layers}
            got = (pooled_row_sets(hidden, sets, student, nd.axis.n, row_chunk=3) if together else
                   [pooled_rows(hidden, s.pool, student, s.positions, s.maps, nd.axis.n, with_outputs=s.with_outputs)
                    for s in sets])
            total = sum(a.pow(2).sum() + sum(z.sum() for z in outs[0].values()) for a, outs in got)
            total.backward()
        results.append([(a.detach(), {l: z.detach() for l, z in outs[0].items()}) for a, outs in got])
        grads.append(student.geometry.layers[layers[0]].k_proj.weight.grad.clone())
    for (a1, z1), (a2, z2) in zip(*results):
        torch.testing.assert_close(a1, a2)
        assert z1.keys() == z2.keys()
        for l in z1:
            torch.testing.assert_close(z1[l], z2[l])
    torch.testing.assert_close(grads[0], grads[1])


def test_a_left_out_near_tie_leaves_the_gradient_finite(setup):
    # an event whose student margin is exactly 0 (its competitor is its own target) is left out of
    # the interaction term; c divides by the margin, so the backward must not see 0 * inf
    import dataclasses

    corpus, note, teacher, events, nd_t, pools_t, targets = setup
    student = tiny_model("qwen3", layers=2, heads=4, kv_heads=2, d_head=16, d_model=64, seed=2)
    nd_s = build_note_data(note, corpus.inventory, student.tokenizer, events)
    eid = next(e for e, r in nd_s.realized.items() if r.event.kind == "P2")
    r = nd_s.realized[eid]
    nd_s.realized[eid] = dataclasses.replace(r, competitor_ids=(r.target_id,))
    pairing = pair_rows(nd_s, nd_t.realized.values(), targets, window=8, teacher_trace_start=nd_t.trace_start)
    pools_s = model_pools(_head_sets(student, 1), student.geometry.head_names(), k=4)
    student.model.requires_grad_(True)
    loss, parts = micro_step_loss(student.model, student, nd_s, targets, pairing, pools_s,
                                  resolve_arm("mistill", "terms=interaction"))
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in student.model.parameters() if p.grad is not None)
    assert np.isfinite(parts["P2/interaction"])


def test_blocks_run_during_the_forward_and_equal_the_deferred_path(setup, monkeypatch):
    """RowSetBlocks runs each layer's block while the forward is at that layer; the loss and
    every gradient equal those of blocks run after the forward (the fallback path)."""
    import mistill.distill.objective as obj
    from mistill.distill.attention_rows import in_plain_forward

    corpus, note, teacher, events, nd_t, pools_t, targets = setup
    student = tiny_model("qwen3", layers=3, heads=4, kv_heads=2, d_head=16, d_model=64, seed=5)
    nd_s = build_note_data(note, corpus.inventory, student.tokenizer, events)
    pairing = pair_rows(nd_s, nd_t.realized.values(), targets, window=8, teacher_trace_start=nd_t.trace_start)
    pools_s = model_pools(_head_sets(student, 3), student.geometry.head_names(), k=5)
    student.model.requires_grad_(True)
    student.model.train()
    from mistill.distill.trainer import checkpoint_layers

    assert checkpoint_layers(student.model)  # the trainer's checkpointing: hooks stay outside it
    seen: list[tuple[int, bool]] = []
    real_call = obj.RowSetBlocks.__call__

    def spy(self, layer, hidden):
        seen.append((layer, in_plain_forward()))
        real_call(self, layer, hidden)
    monkeypatch.setattr(obj.RowSetBlocks, "__call__", spy)

    def run(eager: bool):
        monkeypatch.setattr(obj.RowSetBlocks, "_eager_ok", eager, raising=False)
        student.model.zero_grad(set_to_none=True)
        loss, parts = micro_step_loss(student.model, student, nd_s, targets, pairing, pools_s,
                                      resolve_arm("mistill"))
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in student.model.named_parameters() if p.grad is not None}

    eager_loss, eager_grads = run(True)
    assert seen and all(plain for _, plain in seen)  # the hook saw a plain forward at every pool layer
    deferred_loss, deferred_grads = run(False)
    torch.testing.assert_close(eager_loss, deferred_loss, rtol=1e-5, atol=1e-6)
    assert eager_grads.keys() == deferred_grads.keys()
    for name in eager_grads:
        torch.testing.assert_close(eager_grads[name], deferred_grads[name], rtol=1e-4, atol=1e-6)


def test_in_plain_forward_is_false_inside_a_checkpoint():
    import torch.utils.checkpoint as cp

    from mistill.distill.attention_rows import in_plain_forward

    seen = []
    x = torch.ones(2, requires_grad=True)

    def f(a):
        seen.append(in_plain_forward())
        return a * 2
    assert in_plain_forward()
    cp.checkpoint(f, x, use_reentrant=False).sum().backward()
    cp.checkpoint(f, x, use_reentrant=True).sum().backward()
    with torch.no_grad():
        assert not in_plain_forward()
    assert seen[0] is False and all(s is False for s in seen)


def test_row_maps_and_event_tables_equal_the_per_row_references(setup):
    corpus, note, teacher, events, nd_t, pools_t, targets = setup
    ids = list(nd_t.realized)
    rows = ids + [None, None]
    maps = nd_t.row_maps(rows, "cpu")
    want = torch.stack([nd_t.row_map(e) for e in rows])
    assert torch.equal(maps, want)
    assert any(nd_t.carve(e)[0].numel() for e in ids if nd_t.realized[e].event.kind != "P1")
    target, comp, region = nd_t.event_tables(ids, "cpu")
    for i, e in enumerate(ids):
        r = nd_t.realized[e]
        assert int(target[i]) == r.target_id
        assert comp[i][comp[i] >= 0].tolist() == list(r.competitor_ids)
        assert sorted(torch.nonzero(region[i]).reshape(-1).tolist()) == sorted(set(nd_t.region(e)))
