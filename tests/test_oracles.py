"""Independent oracles for the core quantities.

Each expectation here is computed without the code under test: plain Hugging Face forwards of the
tiny random models over the tokens a measurement sees, with pre-hooks on every ``o_proj`` to read
or replace head outputs (:mod:`oracle_fixtures`), or arithmetic written out by hand. The code under
test runs on its own paths (the instrument's cached single-position forwards, folded rows, late
starts; the objective's chunked loss); only the inputs are shared. Everything is float32 on CPU.

Tolerances are stated in units of float32's machine epsilon ``EPS32`` (1.19e-7) and explained where
they are used. A planted error in any of these quantities (an off-by-one row, a scaled
attribution, a mean over other rows, another set member) moves a value by orders of magnitude
more than the tolerance.
"""

from __future__ import annotations

import copy
import math
import types

import numpy as np
import pytest
import torch

import oracle_fixtures as O
from mistill.distill.arms import resolve_arm
from mistill.distill.losses import chunked_cot_loss
from mistill.distill.objective import Pairing, micro_step_loss
from mistill.distill.targets import teacher_targets
from mistill.instrument.calibration import NoteImportance, calibrate, global_set, head_sets_json
from mistill.instrument.hooks import HeadHook
from mistill.instrument.passes import (AttributionConfig, EventQuery, KnockinConfig, first_order_sweep,
                                       knockin_sweep, prefill_note)
from mistill.instrument.patching import EventVariants, Query, clean_read, run_event_variants, run_variants
from mistill.instrument.runner import Runner
from mistill.models.loading import tiny_model
from model_fixtures import sharpen

EPS32 = float(torch.finfo(torch.float32).eps)
FAMILIES = ("qwen3", "llama")


def _model(family: str, *, logit_scale: int = 8):
    return sharpen(tiny_model(family, layers=3, heads=4, kv_heads=2, d_head=16, d_model=64, seed=1,
                              logit_scale=logit_scale))


@pytest.fixture(scope="module", params=FAMILIES)
def lm(request):
    return _model(request.param)


def _ids(n: int, seed: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _tok(lm, chars: str) -> list[int]:
    return [lm.tokenizer.convert_tokens_to_ids(c) for c in chars]


def _margin_tol(*margins: float) -> float:
    """How far two float32 computations of one margin may differ.

    The instrument reads a margin from a single-position forward against its key-value prefix,
    through its own attention kernels; the reference from a full forward of the same tokens
    through Hugging Face's. The two round differently in every sum: a margin (a difference of
    logits of a few nats after three layers) ends a few ulps of its size apart (observed: below
    3 EPS32 x max(1, |m|)). 64 EPS32 x max(1, |m|) leaves twenty-fold headroom; the errors the
    tests guard against move a margin by 1e-3 or more.
    """
    return 64 * EPS32 * max(1.0, *(abs(m) for m in margins))


# ===================================================================================== L_CoT
def _log_probs(lm, ids: torch.Tensor) -> torch.Tensor:
    """Next-token log-probabilities at every position ``[pos, vocab]``, float64 from the model's
    float32 logits (one plain forward)."""
    with torch.no_grad():
        logits = lm.model(input_ids=ids.view(1, -1), use_cache=False).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


def _cot_rows(lp: torch.Tensor, rows: torch.Tensor, ids_next: torch.Tensor, top_ids: torch.Tensor,
              top_logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row ``t``: the cross-entropy ``-log q_t(ids_next[t])`` and
    ``KL(p_t || q_t) = sum_j p_tj (log p_tj - log q_t(top_ids[t, j]))`` over the teacher's ids with
    positive probability, ``p_t`` the softmax of ``top_logp[t]``, ``q_t = lp[rows[t]]``."""
    q = lp[rows]
    ce = -q.gather(1, ids_next.view(-1, 1)).squeeze(1)
    log_p = torch.log_softmax(top_logp.double(), dim=-1)
    p = log_p.exp()
    term = torch.where(p > 0, p * (torch.where(p > 0, log_p, 0.0) - q.gather(1, top_ids)), 0.0)
    return ce, term.sum(1)


def _cot_tol(lp_rows: torch.Tensor) -> float:
    """CE and KL are log-softmax reads of float32 logits over the whole vocabulary: each row's
    ``log Z`` carries a few ulps of ``max |logit| + log V``; the mean over rows no more. 64 EPS32
    of that scale (about 2e-4 here) is far below what one row of misalignment moves (> 0.1)."""
    scale = float(lp_rows.abs().max()) + math.log(lp_rows.shape[-1])
    return 64 * EPS32 * scale


def _no_rows() -> Pairing:
    empty = np.zeros(0, dtype=np.int64)
    return Pairing(rows=[], teacher_row=empty, teacher_event=empty)


def _student(ids: torch.Tensor, trace_start: int):
    """The parts of a note the CoT loss reads: its tokens and where its trace starts."""
    return types.SimpleNamespace(input_ids=ids, trace_start=trace_start, axis=types.SimpleNamespace(n=1))


@pytest.fixture(scope="module")
def cot_lm():
    # a large output scale makes the next-token distributions differ strongly between positions
    return _model("qwen3", logit_scale=24)


def _greedy(lm, prompt: torch.Tensor, n_new: int) -> torch.Tensor:
    """``prompt`` followed by the model's own greedy continuation of ``n_new`` tokens."""
    ids = prompt.clone()
    with torch.no_grad():
        for _ in range(n_new):
            nxt = lm.model(input_ids=ids.view(1, -1), use_cache=False, logits_to_keep=1).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1)])
    return ids


def test_cot_kl_of_the_teacher_against_itself_is_minus_log_top32_mass(cot_lm):
    """Student = teacher: the teacher's stored top-32 row ``t`` renormalised is ``p_t / M_t`` with
    ``M_t`` the full softmax's mass on those 32 ids, so ``KL = sum p/M (log(p/M) - log p) =
    -log M_t`` exactly; the CE is the trace tokens' mean negative log-likelihood. Both read the
    rows at positions ``ts-1 .. n-2`` (row ``t`` predicts token ``ts + t``)."""
    lm = cot_lm
    ts, n = 24, 64
    ids = _greedy(lm, _ids(ts, 3, lm.geometry.vocab), n - ts)  # a trace the teacher itself writes
    targets = teacher_targets(lm, ids, ts, [], {}, lambda key: None, 1, [])
    with torch.no_grad():
        _, parts = micro_step_loss(lm.model, lm, _student(ids, ts), targets, _no_rows(), {},
                                   resolve_arm("vanilla-fp32"))
    lp = _log_probs(lm, ids)
    rows = torch.arange(ts - 1, n - 1)
    top = lp[rows].topk(32, dim=-1).values
    kl_want = float(-torch.logsumexp(top, dim=-1).mean())
    ce_want = float(-lp[rows].gather(1, ids[ts:].view(-1, 1)).mean())
    tol = _cot_tol(lp)
    assert parts["n_tokens"] == n - ts
    assert parts["kl"] == pytest.approx(kl_want, abs=tol)
    assert parts["ce"] == pytest.approx(ce_want, abs=tol)
    # the same teacher rows read against the student's rows one position later or earlier
    for shift in (1, -1):
        srows = rows + shift
        ce_s, kl_s = _cot_rows(lp, srows, ids[ts:], torch.as_tensor(targets["top_ids"]),
                               torch.as_tensor(targets["top_logp"]))
        assert abs(parts["kl"] - float(kl_s.mean())) > 100 * tol, shift
        assert abs(parts["ce"] - float(ce_s.mean())) > 100 * tol, shift


def test_cot_loss_rows_on_a_two_token_trace(cot_lm):
    """A two-token trace with hand-built teacher rows (different ids and shapes per row, one
    zero-probability id): the code's CE and KL equal the direct computation of rows 0 and 1 one
    at a time (a one-token trace holding each row) and their mean (the two-token trace); the
    expectation with the teacher rows one row off differs."""
    lm = cot_lm
    vocab = lm.geometry.vocab
    ids = _ids(12, 5, vocab)
    n = ids.numel()
    gen = torch.Generator().manual_seed(9)
    top_ids = torch.stack([torch.randperm(vocab, generator=gen)[:32] for _ in range(2)])
    top_ids[0, 0] = ids[n - 2]  # row 0's teacher row puts mass on the token that follows it
    top_logp = torch.stack([torch.linspace(0.0, -6.0, 32), -0.5 * torch.rand(32, generator=gen)])
    top_logp[1, 5] = -math.inf
    lp = _log_probs(lm, ids)
    ce, kl = _cot_rows(lp, torch.tensor([n - 3, n - 2]), ids[n - 2:], top_ids, top_logp)
    tol = _cot_tol(lp)
    arm = resolve_arm("vanilla-fp32")

    def code(tokens, ts, rows):
        t = {"top_ids": top_ids[rows].numpy(), "top_logp": top_logp[rows].numpy()}
        with torch.no_grad():
            return micro_step_loss(lm.model, lm, _student(tokens, ts), t, _no_rows(), {}, arm)[1]

    row0 = code(ids[:n - 1], n - 2, [0])  # trace = token n-2, read at position n-3
    row1 = code(ids, n - 1, [1])  # trace = token n-1, read at position n-2
    both = code(ids, n - 2, [0, 1])
    assert row0["ce"] == pytest.approx(float(ce[0]), abs=tol) and row0["kl"] == pytest.approx(float(kl[0]), abs=tol)
    assert row1["ce"] == pytest.approx(float(ce[1]), abs=tol) and row1["kl"] == pytest.approx(float(kl[1]), abs=tol)
    assert both["ce"] == pytest.approx(float(ce.mean()), abs=tol)
    assert both["kl"] == pytest.approx(float(kl.mean()), abs=tol)
    # teacher rows paired one row off: with the student's rows one later / one earlier, or the
    # two teacher rows swapped
    for rows, t_ids, t_logp in ((torch.tensor([n - 2, n - 1]), top_ids, top_logp),
                                (torch.tensor([n - 4, n - 3]), top_ids, top_logp),
                                (torch.tensor([n - 3, n - 2]), top_ids.flip(0), top_logp.flip(0))):
        _, kl_s = _cot_rows(lp, rows, ids[n - 2:], t_ids, t_logp)
        assert abs(both["kl"] - float(kl_s.mean())) > 100 * tol


def test_chunked_cot_loss_row_by_row_by_hand():
    """Two rows, vocabulary 5, top-3, written out with ``math``: one-hot token weights pick each
    row out of the weighted means; uniform weights give their mean. The values are below 10 and
    a log-softmax over 5 float32 logits of size ~1 is good to a few EPS32: 16 EPS32 x 10."""
    hidden = torch.tensor([[0.5, -1.0, 2.0], [1.5, 0.25, -0.75]])
    weight = torch.tensor([[1.0, 0.0, 0.5], [-0.5, 1.0, 0.0], [0.25, 0.25, 1.0],
                           [0.0, -1.0, 0.5], [1.0, 1.0, -1.0]])
    targets = torch.tensor([2, 4])
    top_ids = torch.tensor([[2, 0, 1], [4, 3, 0]])
    top_logp = torch.tensor([[-0.1, -1.0, -3.0], [0.7, 0.2, -math.inf]])

    def by_hand(student_row: int, teacher_row: int) -> tuple[float, float]:
        """CE of the student row's target and KL of the teacher row against the student row."""
        logits = [sum(float(weight[v, j]) * float(hidden[student_row, j]) for j in range(3)) for v in range(5)]
        log_z = math.log(sum(math.exp(x) for x in logits))
        ce = log_z - logits[int(targets[student_row])]
        raw = [float(x) for x in top_logp[teacher_row]]
        log_norm = math.log(sum(math.exp(x) for x in raw if x != -math.inf))
        kl = sum(math.exp(x - log_norm) * ((x - log_norm) - (logits[int(i)] - log_z))
                 for x, i in zip(raw, top_ids[teacher_row]) if x != -math.inf)
        return ce, kl

    want = [by_hand(0, 0), by_hand(1, 1)]
    tol = 16 * EPS32 * 10
    for w, expect in (([1.0, 0.0], want[0]), ([0.0, 1.0], want[1]),
                      ([1.0, 1.0], tuple((a + b) / 2 for a, b in zip(*want)))):
        _, parts = chunked_cot_loss(hidden, weight, targets, top_ids, top_logp, chunk=1,
                                    token_weights=torch.tensor(w))
        assert float(parts["ce"]) == pytest.approx(expect[0], abs=tol), w
        assert float(parts["kl"]) == pytest.approx(expect[1], abs=tol), w
    # a teacher row one row off gives other numbers
    assert abs(want[0][1] - by_hand(0, 1)[1]) > 0.1 and abs(want[1][1] - by_hand(1, 0)[1]) > 0.1


# =============================================================================== attribution
def _float64_copy(model):
    """A float64 copy whose RMS norms also compute in float64 (Hugging Face's cast to float32
    inside them would put float32 rounding back into every difference quotient)."""
    dm = copy.deepcopy(model).double()

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    for module in dm.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = types.MethodType(forward, module)
    return dm


def _events(ids: torch.Tensor, lm, positions, kind: str = "P1") -> list[EventQuery]:
    letters = _tok(lm, "ABCDEFG")
    out = []
    for i, p in enumerate(positions):
        target = letters[i % len(letters)]
        out.append(EventQuery(f"e{p}", kind, Query(p, int(ids[p]), target, tuple(x for x in letters if x != target)),
                              target=str(i)))
    return out


@pytest.mark.parametrize("detach", (False, True), ids=("intact", "detached"))
def test_attribution_value_equals_autograd_and_central_difference(lm, detach):
    """``A_h = (mu_h - z_h) . d margin / d z_h`` in value, for every head at three events (two in
    one batched backward, one alone), against

    - autograd through a full forward whose last-position head outputs are made leaves
      (:func:`oracle_fixtures.attribution_autograd`), the graph intact or cut at every head
      output; tolerance 128 EPS32 x max(1, max |A|): both sides are float32 gradients through
      three layers, summed in another order (observed: up to 16 EPS32 x max |A|);
    - a central difference of the margin along ``mu_h - z_h`` in a float64 copy of the model
      (later heads left free, or pinned to their clean values for the cut graph); its
      truncation error ``s^2 m'''/6`` is estimated from the step ``2s`` (``|D(2s) - D(s)| / 3``)
      and added to the tolerance; float64 rounding (1e-16 / s) is negligible.

    The sweep reports ``-A_h`` (importance); the per-head means come from its own prefill (the
    reference recomputes them, see the mean test).
    """
    ids = _ids(40, 1, lm.geometry.vocab)
    events = _events(ids, lm, (17, 28, 39))
    runner, hook = Runner(lm, chunk_size=16), HeadHook(lm.geometry)
    sweep = first_order_sweep(runner, hook, "n", ids, events, AttributionConfig(detach=detach, grad_batch=2),
                              progress=False)
    mean = O.mean_z(lm.model, ids)
    dm = _float64_copy(lm.model)
    n_heads = lm.geometry.n_total_heads
    for i, ev in enumerate(events):
        q = ev.query
        sub = ids[:q.position + 1]
        code = -torch.from_numpy(sweep.first_order[i]).double()
        want = O.attribution_autograd(lm.model, sub, q.target_id, q.competitor_ids, mean, detach=detach).flatten()
        tol = 128 * EPS32 * max(1.0, float(want.abs().max()))
        assert float(sweep.margins[i]) == pytest.approx(
            float(O.margin(O.clean_z(lm.model, sub)[1], q.target_id, q.competitor_ids)),
            abs=_margin_tol(float(sweep.margins[i])))
        assert torch.allclose(code, want, rtol=0, atol=tol), (ev.event_id, float((code - want).abs().max()))
        assert float(want.abs().max()) > 0.1  # large enough for a scale error to show
        if i != 1:  # the difference quotients at the event inside the batched backward
            continue
        s, z0 = 1e-3, O.clean_z(dm, sub)[0]
        fd, fd2 = (torch.tensor([O.attribution_finite_difference(dm, sub, q.target_id, q.competitor_ids,
                                                                 mean.double(), h, detach=detach, step=step, z0=z0)
                                 for h in range(n_heads)]) for step in (s, 2 * s))
        trunc = (fd2 - fd).abs() / 3
        assert torch.all((code - fd).abs() <= tol + 4 * trunc + 1e-9), (ev.event_id, float((code - fd).abs().max()))
    # the two graphs give different numbers here (the reference tells them apart)
    q = events[0].query
    other = O.attribution_autograd(lm.model, ids[:q.position + 1], q.target_id, q.competitor_ids, mean,
                                   detach=not detach).flatten()
    assert float((other + torch.from_numpy(sweep.first_order[0]).double()).abs().max()) > 1e-3


# ====================================================================================== mean
@pytest.mark.parametrize("chunk", (16, 20, 8192))
def test_ablation_mean_is_the_hooked_mean_over_every_position(lm, chunk):
    """The per-head mean the instrument ablates to: every position of the note's input (prompt
    and trace), whatever the prefill's chunking, in float32. Reference: the hooked ``o_proj``
    inputs of one full forward, summed in float64. The head outputs themselves differ between
    the two attention paths by an ulp or two (observed 1 EPS32 of max |z|); 32 EPS32 x
    max(1, max |z|). A mean that left out one row moves it by ~|z|/n, far more."""
    ids = _ids(48, 2, lm.geometry.vocab)
    runner, hook = Runner(lm, chunk_size=chunk), HeadHook(lm.geometry)
    _, mean = prefill_note(runner, hook, ids)
    want = O.mean_z(lm.model, ids)
    g = lm.geometry
    assert mean.dtype == want.dtype == torch.float32
    assert mean.shape == (g.n_layers, g.n_heads, g.d_head)
    tol = 32 * EPS32 * max(1.0, float(want.abs().max()))
    assert torch.allclose(mean.cpu(), want, rtol=0, atol=tol), float((mean.cpu() - want).abs().max())
    for other in (O.mean_z(lm.model, ids[:-1]), O.mean_z(lm.model, ids[1:])):
        assert float((other - want).abs().max()) > 100 * tol  # another set of rows is visible


def test_ablation_mean_is_float32_for_a_bf16_model():
    """The mean is accumulated in float64 and kept in float32 whatever the model's dtype. In
    bf16 the two attention paths' head outputs differ by bf16 rounding (2^-8 relative), so the
    values agree to 2^-6 x max |z| only; the dtype and the rows are what this checks."""
    lm = tiny_model("qwen3", layers=3, heads=4, kv_heads=2, d_head=16, d_model=64, seed=1, dtype="bfloat16")
    ids = _ids(48, 2, lm.geometry.vocab)
    _, mean = prefill_note(Runner(lm, chunk_size=16), HeadHook(lm.geometry), ids)
    want = O.mean_z(lm.model, ids)
    assert mean.dtype == torch.float32
    assert torch.allclose(mean.cpu(), want, rtol=0, atol=2 ** -6 * float(want.abs().max()))


# ============================================================================ sets and patching
HAND = {"P1": [5, 0, 9, 2, 11, 3, 4, 6, 1, 7, 8, 10], "P2": [8, 1, 6, 3, 2, 0, 4, 5, 7, 9, 10, 11]}
"""Hand-picked rankings: the global top-k is the first k, the bottom-k the last k reversed."""


def _two_notes(lm):
    """Two random notes with events the donor rules can match (same kind, another target)."""
    vocab = lm.geometry.vocab
    a, b = _ids(48, 11, vocab), _ids(52, 12, vocab)
    L, D = _tok(lm, "ABCDEFG"), _tok(lm, "0123")

    def ev(ids, eid, kind, p, target, t_id, comps, char=None):
        return EventQuery(eid, kind, Query(p, int(ids[p]), t_id, tuple(comps)), target=target, char_index=char)

    ea = [ev(a, "a1", "P1", 22, "A", L[0], L[1:]), ev(a, "a2", "P1", 31, "C", L[2], L[:2] + L[3:]),
          ev(a, "a3", "P2", 41, "1", D[1], [D[0], D[2], D[3]], 1)]
    eb = [ev(b, "b1", "P1", 27, "B", L[1], [L[0]] + L[2:]), ev(b, "b2", "P1", 36, "D", L[3], L[:3] + L[4:]),
          ev(b, "b3", "P2", 45, "2", D[2], [D[0], D[1], D[3]], 1)]
    return a, ea, b, eb


def _hand_set(kind: str, name: str, k: int) -> list[int]:
    return HAND[kind][:k] if name == "global" else HAND[kind][::-1][:k]


def _necessity_tol(clean: float, ablated: float) -> float:
    """The margin tolerance carried through ``(clean - ablated) / clean``."""
    d = _margin_tol(clean, ablated)
    return d * (1.0 + abs(ablated / clean)) / abs(clean)


def _recovery_tol(m_corr: float, m_all: float, m_set: float) -> float:
    """The margin tolerance carried through ``(m_set - m_corr) / (m_all - m_corr)``."""
    d = _margin_tol(m_corr, m_all, m_set)
    r = abs((m_set - m_corr) / (m_all - m_corr))
    return d * (2.0 + 2.0 * r) / abs(m_all - m_corr)


def test_necessity_and_recovery_of_hand_picked_sets(lm):
    """Necessity (mean-ablation of a set at the note's own event) and knock-in recovery (the set's
    clean outputs in the next note's context at a matched event) for the global and bottom sets of
    hand-picked rankings, k = 1, 3, 5, against plain forwards; knocking in every head gives the
    clean margin back. Margins within :func:`_margin_tol`; the shares within it carried through
    their ratios."""
    a, ea, b, eb = _two_notes(lm)
    n_heads = lm.geometry.n_total_heads
    cfg = KnockinConfig(k_bins=(1, 3, 5), sets=("global", "bottom"), range_gate=0.05)
    runner, hook = Runner(lm, chunk_size=16), HeadHook(lm.geometry)
    clean = knockin_sweep(runner, hook, "a", a, ea, cfg, HAND, trace_start=10, progress=False)
    donor = knockin_sweep(runner, hook, "b", b, eb, cfg, HAND, previous=clean.clean, trace_start=10, progress=False)
    mean = O.mean_z(lm.model, a)
    by_id = {e.event_id: e for e in ea}
    assert len(clean.necessity) == len(ea) * 3 * 2
    for r in clean.necessity:
        ev, key = by_id[r["event_id"]], (r["set"], r["k"])
        want = O.reference_necessity(lm.model, a, ev.query, {key: _hand_set(ev.kind, *key)}, mean)
        clean_m, ablated = want["clean_margin"], want["ablated_margin"][key]
        assert r["clean_margin"] == pytest.approx(clean_m, abs=_margin_tol(clean_m)), r["event_id"]
        assert r["ablated_margin"] == pytest.approx(ablated, abs=_margin_tol(ablated)), (r["event_id"], key)
        assert r["necessity"] == pytest.approx(want["necessity"][key], abs=_necessity_tol(clean_m, ablated)), \
            (r["event_id"], key)
    donors = {e.event_id: e for e in eb}
    assert {r["event_id"] for r in donor.knockin} == set(by_id)
    n_gated = 0
    for eid in by_id:
        rows = [r for r in donor.knockin if r["event_id"] == eid]
        ev, match = by_id[eid], donors[rows[0]["donor_event_id"]]
        assert match.kind == ev.kind and match.target != ev.target
        sets = {(r["set"], r["k"]): _hand_set(ev.kind, r["set"], r["k"]) for r in rows}
        assert len(sets) == len(rows) == 3 * 2
        want = O.reference_knockin(lm.model, a, ev.query, b, match.query.position, sets, n_heads)
        assert want["m_all"] == pytest.approx(want["clean_margin"], abs=_margin_tol(want["clean_margin"]))
        for r in rows:
            key = (r["set"], r["k"])
            for m, w in (("m_corr", want["m_corr"]), ("m_all", want["m_all"]), ("m_set", want["m_set"][key])):
                assert r[m] == pytest.approx(w, abs=_margin_tol(w)), (eid, key, m)
            rng = want["m_all"] - want["m_corr"]
            assert abs(abs(rng) - cfg.range_gate) > 10 * _margin_tol(want["m_all"], want["m_corr"])
            assert r["gated"] == (rng >= cfg.range_gate)
            if r["gated"]:
                n_gated += 1
                assert r["recovery"] == pytest.approx(
                    want["recovery"][key], abs=_recovery_tol(want["m_corr"], want["m_all"], want["m_set"][key]))
            else:
                assert math.isnan(r["recovery"])
    assert n_gated > 0


def test_global_set_members_on_hand_built_importances():
    """``I_c`` = per note (mean over the phase's events - mean over its NULL events), then the
    mean over notes; the global set = the top-k by ``I_c``. Built here so that every note's
    event rows scatter around known means: ``I_c`` is the vector ``c`` below, and head 4, which
    moves every margin alike (NULL included) and has the largest raw importance, is in no top set."""
    n_heads = 8
    c = np.array([0.3, -0.2, 1.1, 0.0, -0.05, 0.8, -0.6, 0.5])
    generic = np.zeros(n_heads)
    generic[4] = 3.0
    rng = np.random.default_rng(0)
    notes = []
    for i in range(4):
        base = rng.normal(size=n_heads)  # the note's own offset, common to all its events
        noise = rng.normal(size=(2, n_heads))
        p1 = base + generic + c + np.concatenate([noise, -noise])  # four rows, mean base + generic + c
        null = base + generic + np.concatenate([noise[:1], -noise[:1]])  # two rows, mean base + generic
        notes.append(NoteImportance(note_id=f"n{i}", patient_id=f"p{i}", kinds=np.array(["P1"] * 4 + ["NULL"] * 2),
                                    importance=np.concatenate([p1, null]).astype(np.float32)))
    cal = calibrate(notes, phases=("P1",))
    # float32 storage of the importances: a few EPS32 of their size (< 5) per mean
    np.testing.assert_allclose(cal.importance_c["P1"], c, atol=64 * EPS32 * 5)
    assert int(np.argmax(cal.importance["P1"])) == 4
    assert global_set(cal.importance_c["P1"], 3).tolist() == [2, 5, 7]
    assert global_set(cal.importance_c["P1"], 5).tolist() == [2, 5, 7, 0, 3]
    names = [f"L{h // 4}H{h % 4}" for h in range(n_heads)]
    doc = head_sets_json(cal, names, ks=(3,), pool_k=3)
    assert doc["P1"]["top"]["3"] == ["L0H2", "L1H1", "L1H3"]
    assert doc["P1"]["bottom"]["3"] == ["L1H2", "L0H1", "L1H0"]


def test_batched_patching_equals_one_forward_per_subset(lm):
    """Many head subsets of two events as rows of shared forwards, batches starting late from the
    clean residual stream (:func:`run_event_variants`, and :func:`run_variants` for one event):
    each row's margin equals one plain forward with exactly that subset's outputs at the event
    set to the note's means. Subsets span one layer, several layers, none and all."""
    ids = _ids(44, 21, lm.geometry.vocab)
    events = _events(ids, lm, (23, 43))
    runner, hook = Runner(lm, chunk_size=16), HeadHook(lm.geometry)
    prefix, mean = prefill_note(runner, hook, ids)
    n = lm.geometry.n_total_heads
    subsets = [[], [0], [5], [11], [9, 10], [4, 5, 6, 7], [0, 5], [3, 7, 10], [8, 1], list(range(n))]
    hidden = {}
    for ev in sorted(events, key=lambda e: -e.query.position):
        prefix.crop(ev.query.position)
        hidden[ev.event_id] = clean_read(runner, hook, prefix, ev.query).hidden_in
    ref_mean = O.mean_z(lm.model, ids)
    want = {ev.event_id: [O.patched_margin(lm.model, ids[:ev.query.position + 1], ev.query.target_id,
                                           ev.query.competitor_ids, s, ref_mean) for s in subsets] for ev in events}
    prefix.uncrop()
    got = run_event_variants(runner, hook, prefix, [EventVariants(ev.query, subsets, hidden[ev.event_id])
                                                    for ev in events], mean, batch_size=4)
    for ev, margins in zip(events, got):
        for s, m, w in zip(subsets, margins.tolist(), want[ev.event_id]):
            assert m == pytest.approx(w, abs=_margin_tol(w)), (ev.event_id, s)
    ev = events[0]
    prefix.crop(ev.query.position)
    one = run_variants(runner, hook, prefix, ev.query, subsets, mean, hidden_in=hidden[ev.event_id], batch_size=3)
    for s, m, w in zip(subsets, one.tolist(), want[ev.event_id]):
        assert m == pytest.approx(w, abs=_margin_tol(w)), s
    # the subsets are told apart: each one's margin differs from the unpatched one
    assert all(abs(w - want[ev.event_id][0]) > 1e-3 for w in want[ev.event_id][1:])
