"""The teacher targets against an independent route on tiny random models.

Independent route: the model's full eager attention (``output_attentions=True``) pooled and
bucketed by a one-hot matrix; ``c`` from the heads' outputs captured at ``o_proj``'s input,
each head's write obtained by calling ``o_proj`` on an input holding only that head's slice,
the final norm's scale read off the module's own output, and the margin's direction from
autograd on :func:`mistill.instrument.events.margin`; top-32 from the plain forward's logits.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mistill.distill.targets import (TARGET_KEYS, FlatPool, TargetEvent, TargetRow, load_targets,
                                     save_targets, teacher_targets, top_k_lowest_id_first)
from mistill.errors import MistillInputError
from mistill.instrument.events import margin
from mistill.models.loading import tiny_model
from model_fixtures import sharpen as _sharpen

N_POS, TRACE_START, N_BUCKETS = 48, 18, 11
FAMILIES = [("qwen3", 2), ("llama", 2), ("smollm3", 4)]


def sharpen(lm, seed: int = 0):
    return _sharpen(lm, seed, final_norm=True)


@pytest.fixture(scope="module", params=FAMILIES, ids=[f[0] for f in FAMILIES])
def lm(request):
    family, layers = request.param
    return sharpen(tiny_model(family, layers=layers, heads=4, kv_heads=2, seed=11,
                              attn_implementation="eager"))


def _note(lm):
    """A note with two phases, window rows, carve-out bucket maps and four events."""
    g = lm.geometry
    ids = torch.randint(0, 2000, (N_POS,), generator=torch.Generator().manual_seed(1))
    last = g.n_layers - 1
    pools = {  # flat heads over several layers, GQA siblings included
        "P1": FlatPool(heads=(0 * 4 + 1, last * 4 + 2, last * 4 + 3), weights=(0.5, 0.3, 0.2)),
        "P1w": FlatPool(heads=(last * 4 + 0,), weights=(1.0,)),
        "P2": FlatPool(heads=(0 * 4 + 0, 0 * 4 + 3, last * 4 + 1), weights=(0.6, 0.25, 0.15)),
    }
    base = torch.clamp(torch.arange(N_POS) // 5, max=N_BUCKETS - 3)
    carved = base.clone()
    carved[30:34] = N_BUCKETS - 1  # a carve-out (e.g. the emitted prefix)
    carved[5:9] = N_BUCKETS - 2
    maps = {"base": base, "carved": carved}
    rows = [TargetRow(p, "P1w", "base") for p in range(22, 30)]
    rows += [TargetRow(30, "P1", "base", 0), TargetRow(41, "P2", "carved", 1),
             TargetRow(44, "P2", "carved", 3), TargetRow(47, "P1", "base", 2),
             TargetRow(TRACE_START, "P2", "carved")]
    events = [TargetEvent(100, (101, 102, 103), (0, 1)), TargetEvent(200, (201,), (N_BUCKETS - 1, 3)),
              TargetEvent(300, (301, 302), (2,)), TargetEvent(400, (401, 402, 403, 404), (N_BUCKETS - 2,))]
    return ids, rows, pools, maps, events


def test_targets_match_independent_route(lm):
    g = lm.geometry
    ids, rows, pools, maps, events = _note(lm)
    t = teacher_targets(lm, ids, TRACE_START, rows, pools, maps.__getitem__, N_BUCKETS, events)
    assert set(t) == set(TARGET_KEYS)

    z_at = {}
    handles = [p.o_proj.register_forward_pre_hook(
        lambda mod, args, l=p.index: z_at.__setitem__(l, args[0][0].detach().clone())) for p in g.layers]
    resid = {}
    handles.append(g.final_norm.register_forward_pre_hook(
        lambda mod, args: resid.__setitem__("x", args[0][0].detach().clone())))
    try:
        with torch.no_grad():
            out = lm.model(ids[None], output_attentions=True)
    finally:
        for h in handles:
            h.remove()
    logits = out.logits[0].float()

    # pooled rows: full attention, pooled, bucketed by a one-hot matrix
    want = torch.zeros(len(rows), N_BUCKETS)
    for i, r in enumerate(rows):
        pool = pools[r.phase]
        a = sum(w * out.attentions[h // g.n_heads][0, h % g.n_heads, r.position]
                for h, w in zip(pool.heads, pool.weights))
        want[i] = a @ F.one_hot(maps[r.bucket_map_key], N_BUCKETS).float()
    # recomputed rows against eager attention (other kernels, other summation order): masses
    # <= 1 agree to a few float32 eps; 2e-6 is about 16 eps (observed: <= 2 eps, default / AVX2 /
    # AVX-512 kernels)
    np.testing.assert_allclose(t["pooled"], want.numpy(), atol=2e-6)
    np.testing.assert_allclose(t["pooled"].sum(1), 1.0, atol=1e-5)
    np.testing.assert_array_equal(t["rows_pos"], [r.position for r in rows])
    assert list(t["rows_phase"]) == [r.phase for r in rows]

    # m and c per event
    for e, ev in enumerate(events):
        i = next(k for k, r in enumerate(rows) if r.event_index == e)
        assert t["event_row"][e] == i
        r = rows[i]
        assert t["m"][e] == pytest.approx(float(want[i, list(ev.region)].sum()), abs=2e-6)
        x = resid["x"][r.position]
        # the pool's direct write: o_proj on an input holding one head's slice, bias removed
        v = torch.zeros(g.d_model)
        with torch.no_grad():
            for h, w in zip(pools[r.phase].heads, pools[r.phase].weights):
                l, hh = divmod(h, g.n_heads)
                only = torch.zeros(g.n_heads * g.d_head)
                only[hh * g.d_head:(hh + 1) * g.d_head] = z_at[l][r.position, hh * g.d_head:(hh + 1) * g.d_head]
                o = g.layers[l].o_proj
                v += w * (o(only) - o(torch.zeros_like(only)))
            # frozen scale s = 1/rms(x) from the module's own output: final_norm(x) = gamma * x * s
            y = g.final_norm(x)
            s = float(((y / g.final_norm.weight) @ x) / (x @ x))
            d_logits = g.lm_head(g.final_norm.weight * v * s)
        lg = logits[r.position].clone().requires_grad_(True)
        mg = margin(lg, ev.target_id, list(ev.competitor_ids))
        (grad,) = torch.autograd.grad(mg, lg)
        c_ref = float(grad @ d_logits) / float(mg.detach())
        assert t["margin"][e] == pytest.approx(float(mg.detach()), rel=1e-5, abs=1e-5)
        assert t["c"][e] == pytest.approx(c_ref, rel=1e-4, abs=1e-5)
    assert np.all(np.abs(t["c"]) > 1e-4)  # non-trivial values were compared


def test_top32_equals_plain_forward(lm):
    ids, rows, pools, maps, events = _note(lm)
    t = teacher_targets(lm, ids, TRACE_START, rows, pools, maps.__getitem__, N_BUCKETS, events,
                        logit_chunk=7)
    with torch.no_grad():
        logp = torch.log_softmax(lm.model(ids[None]).logits[0].float(), dim=-1)
    want = logp[TRACE_START - 1:N_POS - 1]  # predicts tokens TRACE_START..N_POS-1
    vals, idx = want.topk(32, dim=-1)
    assert t["top_ids"].shape == (N_POS - TRACE_START, 32) and t["top_logp"].dtype == np.float32
    # chunked unembedding against the plain forward: a log-prob (about -ln(vocab) = -10.8 here)
    # moves by a few ulps of its size; 16 eps relative (observed: <= 2 eps, default / AVX2 /
    # AVX-512 kernels)
    tol = dict(rtol=16 * float(np.finfo(np.float32).eps), atol=1e-6)
    np.testing.assert_allclose(t["top_logp"], vals.numpy(), **tol)
    # the stored ids carry the stored values, in decreasing order
    np.testing.assert_allclose(np.take_along_axis(want.numpy(), t["top_ids"], axis=1), t["top_logp"], **tol)
    assert np.all(np.diff(t["top_logp"], axis=1) <= 0)
    assert (t["top_ids"] == idx.numpy()).mean() > 0.95  # equal up to near-ties
    assert int(t["trace_start"]) == TRACE_START


def test_top32_breaks_exact_ties_by_lowest_token_id():
    """Every token but two has an all-zero unembedding row, so its logit is exactly 0 whatever
    the kernel: the stored top-32 is the positive special tokens by value, then the lowest ids."""
    lm = tiny_model("qwen3", layers=2, heads=4, kv_heads=2, seed=11)
    g = lm.geometry
    special = [1500, 7]
    w = torch.zeros_like(g.lm_head.weight)
    w[special] = torch.randn(len(special), g.d_model, generator=torch.Generator().manual_seed(3))
    g.lm_head.weight = torch.nn.Parameter(w)  # untied from the embeddings
    ids, rows, pools, maps, events = _note(lm)
    t = teacher_targets(lm, ids, TRACE_START, rows, pools, maps.__getitem__, N_BUCKETS, events,
                        logit_chunk=7)
    with torch.no_grad():
        logits = lm.model(ids[None]).logits[0, TRACE_START - 1:N_POS - 1].float()
    zero_ids = [j for j in range(g.vocab) if j not in special]
    for got, lg in zip(t["top_ids"].tolist(), logits):
        assert all(abs(float(lg[j])) > 1e-3 for j in special)  # clear of the tie at 0
        above = sorted((j for j in special if lg[j] > 0), key=lambda j: -float(lg[j]))
        assert got == above + zero_ids[:32 - len(above)]
    # the rule itself on hand-made ties, more ties than free slots included
    x = torch.tensor([[0.5, 2.0, 0.5, 2.0, -1.0, 0.5, 0.5], [1.0] * 7])
    values, top = top_k_lowest_id_first(x, 4)
    assert top.tolist() == [[1, 3, 0, 2], [0, 1, 2, 3]]
    assert values.tolist() == [[2.0, 2.0, 0.5, 0.5], [1.0] * 4]


def test_save_load_roundtrip_and_bad_inputs(lm, tmp_path):
    g = lm.geometry
    ids, rows, pools, maps, events = _note(lm)
    t = teacher_targets(lm, ids, TRACE_START, rows, pools, maps.__getitem__, N_BUCKETS, events, row_chunk=3)
    path = save_targets(tmp_path / "note.npz", t)
    back = load_targets(path)
    assert set(back) == set(t)
    for k in t:
        np.testing.assert_array_equal(back[k], t[k])
    assert [p.name for p in tmp_path.iterdir()] == ["note.npz"]  # no temporary left behind
    with pytest.raises(MistillInputError):
        load_targets(tmp_path / "missing.npz")
    with pytest.raises(MistillInputError):
        save_targets(tmp_path / "x.npz", {k: v for k, v in t.items() if k != "c"})

    def call(**kw):
        args = dict(lm=lm, note_input_ids=ids, trace_start=TRACE_START, rows=rows, pools=pools,
                    bucket_maps=maps.__getitem__, n_buckets=N_BUCKETS, events=events, note_id="n7")
        args.update(kw)
        return teacher_targets(**args)

    bad = {
        "pools": {**pools, "P1": FlatPool(heads=(g.n_total_heads,), weights=(1.0,))},
        "bucket_maps": lambda key: maps[key][:-1],
        "events": events[:3],  # row with event index 3 points past the list
        "rows": rows[:-2],  # event 2 has no row
        "trace_start": N_POS,
    }
    for field, value in bad.items():
        with pytest.raises(MistillInputError, match="note n7"):
            call(**{field: value})


def test_manifest_names_shapes_dtypes_and_digests_and_holds_no_values(lm):
    """What a restricted corpus uploads of a note's targets: per array its name, shape, dtype and
    the sha256 of its bytes; a change to any value changes that array's digest and nothing else."""
    import hashlib
    import json

    from mistill.distill.targets import targets_manifest

    ids, rows, pools, maps, events = _note(lm)
    t = teacher_targets(lm, ids, TRACE_START, rows, pools, maps.__getitem__, N_BUCKETS, events)
    manifest = targets_manifest(t)["arrays"]
    assert set(manifest) == set(t) >= set(TARGET_KEYS)
    for key, a in t.items():
        a = np.ascontiguousarray(a)
        assert manifest[key] == {"shape": list(a.shape), "dtype": a.dtype.str,
                                 "sha256": hashlib.sha256(a.tobytes()).hexdigest()}, key
    assert manifest["top_ids"]["shape"] == [N_POS - TRACE_START, 32]
    # no values: each entry is a shape (one int per axis), a dtype string and a hex digest
    for entry in manifest.values():
        assert set(entry) == {"shape", "dtype", "sha256"} and len(entry["shape"]) <= 2
        assert all(isinstance(n, int) for n in entry["shape"]) and len(entry["sha256"]) == 64
    assert len(json.dumps(manifest)) < 4096
    changed = dict(t, top_ids=t["top_ids"] + 1)
    other = targets_manifest(changed)["arrays"]
    assert [k for k in t if other[k] != manifest[k]] == ["top_ids"]
