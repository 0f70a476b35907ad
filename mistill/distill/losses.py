"""Loss functions of the distillation arms (docs/METHOD.md; paper Sec. 4.1, App. I.1-I.2, J.2-J.3,
M.1 tier E).

Every function is plain torch, differentiable with respect to the student's inputs; teacher
inputs are treated as constants (detached). Arithmetic runs in float32 (float64 when the student
input is float64), whatever the dtype of the weights. The ``parts`` dictionaries hold *detached*
scalars for logging; the returned loss carries the graph.

**CoT loss** (:func:`chunked_cot_loss`), Vanilla CoT-KD and the first term of every off-policy
arm. At each trace position ``t`` (the student's hidden state after the final norm ``h_t``, the
token the teacher emitted there ``y_t`` and the teacher's precomputed top-32 ``(ids_t, l_t)``):

- ``ce_t  = logsumexp(z_t) - z_t[y_t]`` with ``z_t = W_U h_t`` the student's logits;
- ``kl_t  = sum_{v in ids_t} p_T(v) (log p_T(v) - log p_S(v))`` (``mode="kl"``), where
  ``p_T = softmax(l_t)`` is the teacher renormalised over its own top-32 (**[recon]**: the paper
  says "the top-32 KL", not how the mass outside the top-32 is treated) and ``log p_S(v) =
  z_t[v] - logsumexp(z_t)`` the student's *full-softmax* log-probability at those ids;
- ``uld_t = sum_{i=1..32} | q_(i) - p_(i) |`` (``mode="uld"``), the ULD distance of Boizard et
  al. (2025), "Towards Cross-Tokenizer Distillation: the Universal Logit Distillation Loss for
  LLMs": their loss is ``L_CE + lambda * sum_t sum_i |p_S(sigma_S(i)|t) - p_T(sigma_T(i)|t)|``,
  the closed form of the Wasserstein-1 distance between the two next-token distributions when
  every token is at unit cost from every other, with each distribution's probabilities sorted in
  decreasing order (``sigma``) and the shorter vector zero-padded. **[recon]** Here both sides
  are truncated to 32 ranks (the teacher's stored top-k, ``TargetsConfig.top_k``; App. J.3 says
  only "the same number of bins"): ``p_(i)`` is the i-th largest of the teacher's top-32
  probabilities renormalised over its top-32 (the same target as the KL), ``q_(i)`` the i-th
  largest *full-softmax* probability of the student (not renormalised). The term is zero exactly when the student's
  32 largest probabilities equal the renormalised teacher's, which forces the student's mass
  outside its top-32 to zero, as the KL's minimum does. No vocabulary is shared: the teacher's
  ids are not read in this mode.

``L_CoT = mean_w(ce) + kl_weight * mean_w(kl or uld)`` with ``mean_w`` the token mean, weighted
by ``token_weights`` when given (:func:`event_token_weights`: the event-weighted Vanilla arm of
App. M.1 multiplies both terms by 4 at the teacher's event and window tokens). The vocabulary
logits are computed ``chunk`` positions at a time under ``torch.utils.checkpoint``, so
``[pos, vocab]`` is never held: only one chunk's logits live at a time, forward and backward.

**Mistill terms** per phase P ([recon] defaults, docs/METHOD.md):

- ``L_attn,P = mean_r KL(a_bar_T(r) || a_bar_S(r))`` (:func:`attention_term`);
- ``L_int,P = mean_e (m_S(e) c_S(e) - m_T(e) c_T(e))^2`` (:func:`interaction_term`);
- ``L_write,P = mean_e (c_S(e) - c_T(e))^2`` (:func:`write_term`, pre-registered and removed,
  App. I.2; ``normalize=True`` is ``--write-norm``);
- ``L = L_CoT + sum_P lambda_P (sum of the enabled terms)`` (:func:`mistill_objective`).

**Feature-KD** (App. J.3; :func:`feature_kd_loss`, :func:`feature_kd_hidden_term`,
:func:`uniform_layer_pairs`, :func:`sample_positions`, :func:`make_adapter`): the attention KL
at 64 trace positions sampled per note, the hidden-state MSE at every trace position, chunked;
and **DistiLLM-2** (Ko et al., 2025; :func:`distillm2_loss`): see their docstrings for the
exact formulas.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from functools import partial

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from mistill.errors import MistillInputError

# Defaults of the recipe (App. J.2-J.3, M.1).
TEACHER_TOP_K = 32  # the teacher's precomputed top-k per position
DEFAULT_LOGIT_CHUNK = 1024  # trace positions per logits chunk
EVENT_WEIGHT = 4.0  # event-weighted Vanilla CoT-KD: CE and KL x4 at event and window tokens
ATTENTION_EPS = 1e-8  # clamp of the attention distributions inside the KL
MISTILL_TERMS = ("attention", "interaction", "write")  # names accepted in ``terms``
DEFAULT_MISTILL_TERMS = ("attention", "interaction")  # the objective as run (write removed)
FEATURE_KD_PAIRS = 4  # uniformly mapped layer pairs
FEATURE_KD_POSITIONS = 64  # attention positions sampled per note (the hidden term reads every one)
FEATURE_KD_HIDDEN_CHUNK = 1024  # trace positions per chunk of the hidden-state term
FEATURE_KD_ATTN_WEIGHT = 1.0
FEATURE_KD_HIDDEN_WEIGHT = 1.0
RMS_EPS = 1e-6  # inside the square root of the per-position RMS normalisation

# DistiLLM-2 (Ko et al., 2025) at the released trainer's defaults.
DISTILLM2_ALPHA = 0.1  # skew coefficient of SKL and SRKL (base_alpha_1 = base_alpha_2)
DISTILLM2_BETA = 1.0  # SRKL coefficient; (2 - beta) on SKL. 1.0 = no gradual-beta curriculum
IGNORE_INDEX = -100  # label of a position that carries no loss


# ---------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------

def _compute_dtype(t: Tensor) -> torch.dtype:
    """float64 stays float64; everything else is computed in float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _zero_like_graph(*tensors: Tensor) -> Tensor:
    """A scalar 0 connected to the graph of the given tensors (so ``backward`` works and gives
    zero gradients), in their compute dtype."""
    ref = tensors[0]
    out = ref.new_zeros((), dtype=_compute_dtype(ref))
    for t in tensors:
        if t.requires_grad:
            out = out + t.reshape(-1)[:0].sum().to(out.dtype)
    return out


def _check(cond: bool, message: str, field: str) -> None:
    if not cond:
        raise MistillInputError(message, field=field)


def _detached_parts(parts: Mapping[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.detach() for k, v in parts.items()}


def _row_kl(p: Tensor, q: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Per-row ``KL(p || q) = sum_b p_b (log max(p_b, eps) - log max(q_b, eps))``.

    ``p``, ``q``: ``[row, bucket]``. Entries with ``p_b = 0`` contribute exactly 0. Returns
    ``(kl [row], has_mass [row] bool)``, ``has_mass`` true where the row's teacher mass is > 0.
    """
    dtype = _compute_dtype(q)
    p = p.detach().to(dtype)
    q = q.to(dtype)
    log_p = torch.log(p.clamp_min(eps))
    log_q = torch.log(q.clamp_min(eps))
    terms = torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(log_q))
    return terms.sum(-1), p.sum(-1) > 0


def _mean_row_kl(p: Tensor, q: Tensor, eps: float) -> Tensor:
    """Mean of :func:`_row_kl` over the rows that carry teacher mass; 0 when none does."""
    kl, has_mass = _row_kl(p, q, eps)
    n = has_mass.sum().clamp_min(1).to(kl.dtype)  # no host sync; an empty sum over 1 is 0
    return torch.where(has_mass, kl, torch.zeros_like(kl)).sum() / n


# ---------------------------------------------------------------------------------------------
# CoT loss: CE + top-32 KL (or ULD), chunked logits
# ---------------------------------------------------------------------------------------------

def event_token_weights(n_positions: int, positions: Iterable[int] | Tensor, *,
                        factor: float = EVENT_WEIGHT, device: torch.device | str | None = None,
                        dtype: torch.dtype = torch.float32) -> Tensor:
    """Token weights of the event-weighted Vanilla arm (App. M.1, tier E): ``[pos]``, 1 at every
    trace position and ``factor`` at the listed ones (the teacher's event tokens and the W = 8
    window positions before each P1 event; a position listed twice is weighted once).

    ``positions`` index the same ``pos`` axis as :func:`chunked_cot_loss`'s ``hidden``.
    """
    idx = torch.as_tensor(list(positions) if not isinstance(positions, Tensor) else positions,
                          dtype=torch.long, device=device)
    _check(factor >= 0, f"event weight must be >= 0, got {factor}", "factor")
    if idx.numel():
        _check(int(idx.min()) >= 0 and int(idx.max()) < n_positions,
               f"event positions must lie in [0, {n_positions})", "positions")
    w = torch.ones(n_positions, dtype=dtype, device=device)
    w[idx] = factor
    return w


def _head_vocab(lm_head: nn.Module | Tensor) -> int | None:
    if isinstance(lm_head, Tensor):
        return int(lm_head.shape[0])
    weight = getattr(lm_head, "weight", None)
    if isinstance(weight, Tensor) and weight.dim() == 2:
        return int(weight.shape[0])
    out = getattr(lm_head, "out_features", None)
    return int(out) if out is not None else None


def _cot_chunk(h: Tensor, weight: Tensor | None, targets: Tensor, top_ids: Tensor,
               log_p_t: Tensor, *, head: nn.Module | None, mode: str,
               dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """One chunk: ``h [c, d_model]`` -> ``(ce [c], dist [c])``. The chunk's ``[c, vocab]``
    logits exist only inside this function (recomputed in the backward under checkpoint)."""
    logits = (h @ weight.t()) if head is None else head(h)
    logits = logits.to(dtype)
    log_z = torch.logsumexp(logits, dim=-1)
    ce = log_z - logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if mode == "kl":
        log_q = logits.gather(-1, top_ids) - log_z.unsqueeze(-1)
        p_t = log_p_t.exp()
        safe = torch.where(p_t > 0, log_p_t, torch.zeros_like(log_p_t))
        dist = torch.where(p_t > 0, p_t * (safe - log_q), torch.zeros_like(log_q)).sum(-1)
    else:
        k = top_ids.shape[-1]
        # Sorting logits sorts probabilities: the student's k largest full-softmax probabilities.
        q_sorted = (logits.topk(k, dim=-1).values - log_z.unsqueeze(-1)).exp()
        p_sorted = log_p_t.exp().sort(dim=-1, descending=True).values
        dist = (q_sorted - p_sorted).abs().sum(-1)
    return ce, dist


def chunked_cot_loss(hidden: Tensor, lm_head: nn.Module | Tensor, target_ids: Tensor,
                     teacher_top_ids: Tensor, teacher_top_logp: Tensor, *,
                     kl_weight: float = 1.0, token_weights: Tensor | None = None,
                     chunk: int = DEFAULT_LOGIT_CHUNK, mode: str = "kl",
                     ) -> tuple[Tensor, dict[str, Tensor]]:
    """``L_CoT`` on one trace: cross-entropy on the teacher's tokens + ``kl_weight`` x KL to the
    teacher's top-32 (or ULD), logits computed chunk by chunk.

    Args:
        hidden: ``[pos, d_model]``, the student's hidden states at the trace positions, already
            through the final norm (position ``t`` predicts ``target_ids[t]``).
        lm_head: the unembedding, an ``nn.Module`` mapping ``[c, d_model] -> [c, vocab]`` (e.g.
            ``model.lm_head``) or its weight ``[vocab, d_model]`` (tied embeddings).
        target_ids: ``[pos]`` long, the teacher's emitted token at each position (student ids).
        teacher_top_ids: ``[pos, k]`` long (k = 32), the teacher's top-k ids (student
            vocabulary in ``mode="kl"``; unused in ``mode="uld"``).
        teacher_top_logp: ``[pos, k]``, the teacher's log-probabilities (or logits: only their
            differences matter) at those ids; renormalised here over the k ids. ``-inf`` entries
            are zero-probability ids.
        kl_weight: weight of the KL / ULD term (1 in every arm).
        token_weights: ``[pos]`` non-negative, or None for the plain token mean. Both CE and the
            distillation term become ``sum_t w_t x_t / sum_t w_t``.
        chunk: trace positions per logits chunk (>= 1; need not divide ``pos``).
        mode: ``"kl"``: ``sum_v p_T(v) (log p_T(v) - log p_S(v))`` over the teacher's top-k ids
            with ``p_S`` the student's full softmax; ``"uld"``: ``sum_i |q_(i) - p_(i)|`` over
            the k ranks of the sorted probabilities (module docstring has the exact forms).

    Returns:
        ``(loss, parts)``: ``loss`` scalar; ``parts`` detached scalars ``ce``, ``kl`` or
        ``uld`` (the weighted token means before ``kl_weight``) and ``n_tokens``.
    """
    _check(mode in ("kl", "uld"), f"mode must be 'kl' or 'uld', got {mode!r}", "mode")
    _check(isinstance(chunk, int) and chunk >= 1, f"chunk must be a positive int, got {chunk!r}",
           "chunk")
    _check(hidden.dim() == 2, f"hidden must be [pos, d_model], got {tuple(hidden.shape)}",
           "hidden")
    n_pos = hidden.shape[0]
    _check(n_pos > 0, "no trace positions to train on", "hidden")
    _check(tuple(target_ids.shape) == (n_pos,),
           f"target_ids must be [pos]={n_pos}, got {tuple(target_ids.shape)}", "target_ids")
    _check(teacher_top_ids.dim() == 2 and teacher_top_ids.shape[0] == n_pos,
           f"teacher_top_ids must be [pos, k], got {tuple(teacher_top_ids.shape)}",
           "teacher_top_ids")
    _check(teacher_top_logp.shape == teacher_top_ids.shape,
           "teacher_top_logp must have the shape of teacher_top_ids", "teacher_top_logp")
    k = teacher_top_ids.shape[1]
    _check(k >= 1, "the teacher's top-k is empty", "teacher_top_ids")
    vocab = _head_vocab(lm_head)
    if isinstance(lm_head, Tensor):
        _check(lm_head.dim() == 2 and lm_head.shape[1] == hidden.shape[1],
               f"lm_head weight must be [vocab, d_model={hidden.shape[1]}], "
               f"got {tuple(lm_head.shape)}", "lm_head")
    if vocab is not None:
        _check(int(target_ids.min()) >= 0 and int(target_ids.max()) < vocab,
               f"target ids must lie in [0, {vocab})", "target_ids")
        if mode == "kl":
            _check(int(teacher_top_ids.min()) >= 0 and int(teacher_top_ids.max()) < vocab,
                   f"teacher top ids must lie in the student's vocabulary [0, {vocab}); "
                   "use mode='uld' across tokenizers", "teacher_top_ids")
        else:
            _check(k <= vocab, f"top-k {k} exceeds the student's vocabulary {vocab}",
                   "teacher_top_ids")
    dtype = _compute_dtype(hidden)
    if token_weights is None:
        weights = torch.ones(n_pos, dtype=dtype, device=hidden.device)
    else:
        _check(tuple(token_weights.shape) == (n_pos,),
               f"token_weights must be [pos]={n_pos}, got {tuple(token_weights.shape)}",
               "token_weights")
        weights = token_weights.detach().to(device=hidden.device, dtype=dtype)
        _check(bool((weights >= 0).all()) and float(weights.sum()) > 0,
               "token weights must be >= 0 with a positive sum", "token_weights")

    log_p_t = torch.log_softmax(teacher_top_logp.detach().to(device=hidden.device, dtype=dtype),
                                dim=-1)
    top_ids = teacher_top_ids.to(device=hidden.device, dtype=torch.long)
    targets = target_ids.to(device=hidden.device, dtype=torch.long)
    head = None if isinstance(lm_head, Tensor) else lm_head
    weight = lm_head if isinstance(lm_head, Tensor) else None
    fn = partial(_cot_chunk, head=head, mode=mode, dtype=dtype)
    use_ckpt = torch.is_grad_enabled()

    ce_sum = hidden.new_zeros((), dtype=dtype)
    dist_sum = hidden.new_zeros((), dtype=dtype)
    for start in range(0, n_pos, chunk):
        sl = slice(start, min(start + chunk, n_pos))
        args = (hidden[sl], weight, targets[sl], top_ids[sl], log_p_t[sl])
        if use_ckpt:
            ce_c, dist_c = checkpoint(fn, *args, use_reentrant=False)
        else:
            ce_c, dist_c = fn(*args)
        w = weights[sl]
        ce_sum = ce_sum + (w * ce_c).sum()
        dist_sum = dist_sum + (w * dist_c).sum()
    w_total = weights.sum()
    ce = ce_sum / w_total
    dist = dist_sum / w_total
    loss = ce + kl_weight * dist if kl_weight != 0 else ce
    parts = {"ce": ce, ("kl" if mode == "kl" else "uld"): dist,
             "n_tokens": torch.tensor(float(n_pos), dtype=dtype, device=hidden.device)}
    return loss, _detached_parts(parts)


# ---------------------------------------------------------------------------------------------
# Mistill terms
# ---------------------------------------------------------------------------------------------

def attention_term(a_T: Tensor, a_S: Tensor, eps: float = ATTENTION_EPS) -> Tensor:
    """``L_attn,P = mean_r KL(a_bar_T(r) || a_bar_S(r))`` [recon].

    Args:
        a_T: ``[row, bucket]``, the teacher's pooled bucket rows (each a distribution over the
            span buckets; a constant).
        a_S: ``[row, bucket]``, the student's pooled rows at the paired positions.
        eps: both sides are clamped below at ``eps`` inside the logarithms.

    ``KL(p || q) = sum_b p_b (log max(p_b, eps) - log max(q_b, eps))``; buckets with ``p_b = 0``
    contribute 0 (zero-padded bucket columns are therefore harmless). A row whose teacher mass
    is 0 (padding, an unrealised row) contributes 0 and is left out of the mean's count: the
    mean runs over the rows with teacher mass; no such row gives 0.
    """
    _check(a_T.dim() == 2 and a_T.shape == a_S.shape,
           f"a_T and a_S must both be [row, bucket], got {tuple(a_T.shape)} and "
           f"{tuple(a_S.shape)}", "a_S")
    return _mean_row_kl(a_T, a_S, eps)


def interaction_term(m_S: Tensor, c_S: Tensor, m_T: Tensor, c_T: Tensor) -> Tensor:
    """``L_int,P = mean_e (m_S(e) c_S(e) - m_T(e) c_T(e))^2`` [recon].

    All four are ``[event]``: region mass ``m`` (pooled attention on the region buckets) and
    contribution ``c`` (pooled heads' direct-path share of the margin) of the student (``_S``,
    carrying the graph) and the teacher (``_T``, constants). No event gives 0.
    """
    shapes = {tuple(t.shape) for t in (m_S, c_S, m_T, c_T)}
    _check(len(shapes) == 1 and m_S.dim() == 1,
           f"m_S, c_S, m_T, c_T must share one [event] shape, got {sorted(shapes)}", "m_S")
    if m_S.shape[0] == 0:
        return _zero_like_graph(m_S, c_S)
    dtype = _compute_dtype(c_S)
    target = (m_T.detach() * c_T.detach()).to(dtype)
    return ((m_S.to(dtype) * c_S.to(dtype) - target) ** 2).mean()


def _standardize(c: Tensor, groups: Tensor, n_groups: int, eps: float) -> Tensor:
    """``(c - mean_g) / sqrt(var_g + eps)`` within each group (population variance)."""
    counts = torch.zeros(n_groups, dtype=c.dtype, device=c.device).index_add(
        0, groups, torch.ones_like(c))
    mean = torch.zeros(n_groups, dtype=c.dtype, device=c.device).index_add(0, groups, c) / counts
    centred = c - mean[groups]
    var = torch.zeros(n_groups, dtype=c.dtype, device=c.device).index_add(
        0, groups, centred ** 2) / counts
    return centred / torch.sqrt(var[groups] + eps)


def write_term(c_S: Tensor, c_T: Tensor, *, normalize: bool = False,
               note_index: Tensor | None = None, eps: float = 1e-8) -> Tensor:
    """``L_write,P = mean_e (c_S(e) - c_T(e))^2`` (pre-registered, removed; App. I.2).

    Args:
        c_S, c_T: ``[event]`` contributions of student (graph) and teacher (constant).
        normalize: ``--write-norm``: standardise ``c_S`` and ``c_T`` separately over each note's
            events, ``z = (c - mean_note) / sqrt(var_note + eps)`` (population variance), before
            the squared error. A note with one event standardises to 0.
        note_index: ``[event]`` note id of each event (any integers); None = one note.
    """
    _check(c_S.dim() == 1 and c_S.shape == c_T.shape,
           f"c_S and c_T must share one [event] shape, got {tuple(c_S.shape)} and "
           f"{tuple(c_T.shape)}", "c_S")
    if c_S.shape[0] == 0:
        return _zero_like_graph(c_S)
    dtype = _compute_dtype(c_S)
    s = c_S.to(dtype)
    t = c_T.detach().to(dtype)
    if normalize:
        if note_index is None:
            groups = torch.zeros(s.shape[0], dtype=torch.long, device=s.device)
            n_groups = 1
        else:
            _check(tuple(note_index.shape) == tuple(c_S.shape),
                   "note_index must be [event] like c_S", "note_index")
            uniq, groups = torch.unique(note_index.to(s.device), return_inverse=True)
            n_groups = int(uniq.numel())
        s = _standardize(s, groups, n_groups, eps)
        t = _standardize(t, groups, n_groups, eps)
    return ((s - t) ** 2).mean()


def mistill_objective(cot_loss: Tensor, phase_terms: Mapping[str, Mapping[str, Tensor]],
                      lambdas: Mapping[str, float],
                      terms: Sequence[str] = DEFAULT_MISTILL_TERMS,
                      ) -> tuple[Tensor, dict[str, Tensor]]:
    """``L = L_CoT + sum_P lambda_P * (sum of the enabled terms of phase P)``.

    Args:
        cot_loss: scalar ``L_CoT`` (:func:`chunked_cot_loss`).
        phase_terms: per phase (``"P1"``, ``"P2"``, ...) the computed terms by name
            (``"attention"``, ``"interaction"``, ``"write"``), scalars.
        lambdas: ``lambda_P`` per phase. Every phase in ``phase_terms`` needs one. A phase with
            ``lambda_P = 0`` is skipped entirely, so it contributes exactly zero (no ``0 * NaN``)
            and the gradient equals the CoT loss's; it may then lack terms or be absent.
        terms: the enabled terms (``--terms``); default attention + interaction (as run).

    Returns:
        ``(total, parts)``; parts (detached): ``cot``, ``<P>/<term>`` for every enabled term of
        every phase with non-zero lambda, ``<P>/weighted`` = ``lambda_P * sum``, and ``total``.
    """
    unknown = [t for t in terms if t not in MISTILL_TERMS]
    _check(not unknown, f"unknown Mistill terms {unknown}; known: {list(MISTILL_TERMS)}",
           "terms")
    _check(len(set(terms)) == len(terms), f"terms listed twice: {list(terms)}", "terms")
    missing = [p for p in phase_terms if p not in lambdas]
    _check(not missing, f"no lambda for phases {missing}", "lambdas")
    total = cot_loss
    parts: dict[str, Tensor] = {"cot": cot_loss}
    for phase, lam in lambdas.items():
        lam = float(lam)
        _check(math.isfinite(lam) and lam >= 0, f"lambda_{phase} must be finite and >= 0, "
               f"got {lam}", "lambdas")
        if lam == 0.0 or not terms:
            continue
        _check(phase in phase_terms, f"lambda_{phase} = {lam} but no terms for phase {phase}",
               "phase_terms")
        have = phase_terms[phase]
        absent = [t for t in terms if t not in have]
        _check(not absent, f"phase {phase} lacks the enabled terms {absent}", "phase_terms")
        phase_sum = None
        for name in terms:
            value = have[name]
            parts[f"{phase}/{name}"] = value
            phase_sum = value if phase_sum is None else phase_sum + value
        weighted = lam * phase_sum
        parts[f"{phase}/weighted"] = weighted
        total = total + weighted
    parts["total"] = total
    return total, _detached_parts(parts)


# ---------------------------------------------------------------------------------------------
# Feature-KD (App. J.3)
# ---------------------------------------------------------------------------------------------

FEATURE_KD_LAYER_MAPS = ("block_end", "linspace")  # rules of uniform_layer_pairs


def uniform_layer_pairs(n_student_layers: int, n_teacher_layers: int,
                        n_pairs: int = FEATURE_KD_PAIRS, rule: str = "block_end",
                        ) -> list[tuple[int, int]]:
    """The ``n_pairs`` uniformly mapped ``(student_layer, teacher_layer)`` pairs (0-based).

    **[recon]** The paper says "four uniformly mapped layer pairs" (App. J.3) and no more; the
    rule is ``ArmConfig.fkd_layer_map``:

    - ``"block_end"`` (default): split each model's layers into ``n_pairs`` equal blocks and take
      the last layer of each block, ``layer_k = ceil((k + 1) * n_layers / n_pairs) - 1`` for
      ``k = 0..n_pairs-1``; the last pair is always the two last layers. E.g. 36 and 64 layers,
      4 pairs: ``(8, 15), (17, 31), (26, 47), (35, 63)``.
    - ``"linspace"``: ``layer_k = round(k * (n_layers - 1) / (n_pairs - 1))``, from the first
      layer to the last (the first layer alone when ``n_pairs = 1``). E.g. 36 and 64 layers:
      ``(0, 0), (12, 21), (23, 42), (35, 63)``.

    The k-th student layer pairs with the k-th teacher layer.
    """
    _check(n_pairs >= 1, f"n_pairs must be >= 1, got {n_pairs}", "n_pairs")
    _check(rule in FEATURE_KD_LAYER_MAPS, f"rule must be one of {FEATURE_KD_LAYER_MAPS}, "
           f"got {rule!r}", "rule")
    _check(n_student_layers >= n_pairs and n_teacher_layers >= n_pairs,
           f"need at least {n_pairs} layers per model, got {n_student_layers} and "
           f"{n_teacher_layers}", "n_layers")

    def ends(n: int) -> list[int]:
        if rule == "linspace":
            if n_pairs == 1:
                return [0]
            # half-up rounding of k (n - 1) / (n_pairs - 1), in integers (no float ties)
            return [(2 * k * (n - 1) + (n_pairs - 1)) // (2 * (n_pairs - 1)) for k in range(n_pairs)]
        return [-(-((k + 1) * n) // n_pairs) - 1 for k in range(n_pairs)]

    return list(zip(ends(n_student_layers), ends(n_teacher_layers)))


def sample_positions(n_positions: int, k: int = FEATURE_KD_POSITIONS,
                     generator: torch.Generator | None = None) -> Tensor:
    """``k`` distinct indices into ``[0, n_positions)`` drawn uniformly without replacement with
    ``generator`` (the global RNG when None), returned sorted, ``[min(k, n_positions)]`` long
    (every position when there are at most ``k``). The indices address the caller's list of
    trace positions. Feature-KD's attention term reads these positions (App. J.3: "at 64 trace
    positions sampled per note"); its hidden-state term reads every trace position."""
    _check(n_positions >= 0 and k >= 0, "n_positions and k must be >= 0", "k")
    if n_positions <= k:
        return torch.arange(n_positions, dtype=torch.long)
    perm = torch.randperm(n_positions, generator=generator)
    return perm[:k].sort().values


def make_adapter(d_S: int, d_T: int, seed: int, *, bias: bool = True,
                 dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> nn.Linear:
    """The Feature-KD adapter ``nn.Linear(d_S -> d_T)``, initialised from ``seed`` alone.

    **[recon]** The paper names "a linear adapter to the teacher's width" and that its
    initialisation must follow the seed (the adapter-seed caveat of App. J.3), not its
    distribution or whether it has a bias. The parameters are drawn from a local
    ``torch.Generator(seed)`` with torch's default ``nn.Linear`` distribution (weight and bias
    ``U(-1/sqrt(d_S), 1/sqrt(d_S))``); ``bias`` is ``ArmConfig.fkd_adapter_bias``. The global RNG
    is neither read nor advanced, so the initialisation does not depend on what ran before.
    """
    _check(d_S >= 1 and d_T >= 1, f"adapter widths must be >= 1, got {d_S}, {d_T}", "d_S")
    layer = nn.utils.skip_init(nn.Linear, d_S, d_T, bias=bias, dtype=dtype,
                               device=torch.device("cpu") if device is None else device)
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    bound = 1.0 / math.sqrt(d_S)
    with torch.no_grad():
        w = torch.rand((d_T, d_S), generator=gen, dtype=torch.float64) * (2 * bound) - bound
        layer.weight.copy_(w.to(layer.weight.dtype))
        if bias:
            b = torch.rand((d_T,), generator=gen, dtype=torch.float64) * (2 * bound) - bound
            layer.bias.copy_(b.to(layer.bias.dtype))
    return layer


def rms_normalize(h: Tensor, eps: float = RMS_EPS) -> Tensor:
    """``h / sqrt(mean_d h^2 + eps)`` per position: ``[..., d] -> [..., d]`` (no scale).

    **[recon]** The paper RMS-normalises "per position" (App. J.3) without an epsilon;
    ``eps`` (``ArmConfig.fkd_rms_eps``, default 1e-6) keeps an all-zero state finite."""
    h = h.to(_compute_dtype(h))
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def _pair_list(h: Tensor | Sequence[Tensor], name: str) -> list[Tensor]:
    """``[pair, pos, d]`` or a sequence of ``[pos, d]`` -> a list of ``[pos, d]``."""
    if isinstance(h, Tensor):
        _check(h.dim() == 3, f"{name} must be [pair, pos, d], got {tuple(h.shape)}", name)
        return list(h.unbind(0))
    out = list(h)
    _check(bool(out) and all(t.dim() == 2 for t in out),
           f"{name} must be a non-empty sequence of [pos, d] tensors", name)
    return out


def _adapter_list(adapter: nn.Linear | Sequence[nn.Linear], n_pairs: int) -> list[nn.Linear]:
    """One shared adapter (repeated per pair) or one per pair."""
    if isinstance(adapter, nn.Linear):
        return [adapter] * n_pairs
    out = list(adapter)
    _check(len(out) == n_pairs, f"{len(out)} adapters for {n_pairs} layer pairs", "adapter")
    return out


def _hidden_chunk_sum(h_s: Tensor, h_t: Tensor, adapter: nn.Linear, *, eps: float,
                      dtype: torch.dtype) -> Tensor:
    """Summed squared error of one chunk: ``h_s [c, d_S]``, ``h_t [c, d_T]`` -> scalar. The
    chunk's adapted ``[c, d_T]`` states exist only inside this function (recomputed in the
    backward under checkpoint)."""
    adapted = adapter(h_s.to(adapter.weight.dtype))
    diff = rms_normalize(adapted, eps).to(dtype) - rms_normalize(h_t.detach(), eps).to(dtype)
    return diff.pow(2).sum()


def feature_kd_hidden_term(h_T: Tensor | Sequence[Tensor], h_S: Tensor | Sequence[Tensor],
                           adapter: nn.Linear | Sequence[nn.Linear], *,
                           chunk: int = FEATURE_KD_HIDDEN_CHUNK, eps: float = RMS_EPS) -> Tensor:
    """Feature-KD's hidden-state term at every trace position (App. J.3):
    ``mean_{pair, pos, d_T} (rms(h_T) - rms(adapter(h_S)))^2``.

    Args:
        h_T: ``[pair, pos, d_T]`` (or one ``[pos, d_T]`` per pair), the teacher's hidden states
            at every trace position of the pairs' teacher layers (constants; any float dtype,
            cast chunk by chunk).
        h_S: ``[pair, pos, d_S]`` (or one ``[pos, d_S]`` per pair), the student's at the pairs'
            student layers, row ``i`` aligned with the teacher's row ``i``.
        adapter: one ``nn.Linear(d_S -> d_T)`` shared by the pairs, or one per pair.
        chunk: positions per chunk (>= 1). The adapter projection and the squared error run
            ``chunk`` positions at a time under ``torch.utils.checkpoint``, so no
            ``[pos, d_T]`` intermediate of the student side is held; the result and its
            gradients equal the unchunked mean up to floating-point summation order.
        eps: inside the square root of :func:`rms_normalize`.
    """
    _check(isinstance(chunk, int) and chunk >= 1, f"chunk must be a positive int, got {chunk!r}",
           "chunk")
    hs, ht = _pair_list(h_S, "h_S"), _pair_list(h_T, "h_T")
    _check(len(hs) == len(ht), f"{len(hs)} student and {len(ht)} teacher layer pairs", "h_S")
    adapters = _adapter_list(adapter, len(hs))
    for s, t, a in zip(hs, ht, adapters):
        _check(s.shape[0] == t.shape[0] and s.shape[0] > 0,
               f"h_S {tuple(s.shape)} and h_T {tuple(t.shape)} must hold the same positions",
               "h_S")
        _check(a.in_features == s.shape[-1] and a.out_features == t.shape[-1],
               f"adapter maps {a.in_features} -> {a.out_features}, hidden states are "
               f"{s.shape[-1]} -> {t.shape[-1]}", "adapter")
    dtype = _compute_dtype(hs[0])
    use_ckpt = torch.is_grad_enabled()
    total = _zero_like_graph(*hs).to(dtype)
    count = 0
    for s, t, a in zip(hs, ht, adapters):
        fn = partial(_hidden_chunk_sum, adapter=a, eps=eps, dtype=dtype)
        for start in range(0, s.shape[0], chunk):
            sl = slice(start, min(start + chunk, s.shape[0]))
            part = (checkpoint(fn, s[sl], t[sl], use_reentrant=False) if use_ckpt
                    else fn(s[sl], t[sl]))
            total = total + part
        count += s.shape[0] * t.shape[-1]
    return total / count


def feature_kd_loss(a_T: Tensor, a_S: Tensor, h_T: Tensor | Sequence[Tensor],
                    h_S: Tensor | Sequence[Tensor], adapter: nn.Linear | Sequence[nn.Linear], *,
                    attn_weight: float = FEATURE_KD_ATTN_WEIGHT,
                    hidden_weight: float = FEATURE_KD_HIDDEN_WEIGHT,
                    eps: float = ATTENTION_EPS, rms_eps: float = RMS_EPS,
                    hidden_chunk: int = FEATURE_KD_HIDDEN_CHUNK,
                    ) -> tuple[Tensor, dict[str, Tensor]]:
    """Feature-KD (App. J.3): attention KL at the sampled positions + hidden-state MSE at every
    trace position, over the mapped layer pairs.

    Args:
        a_T, a_S: ``[pair, pos_a, bucket]``, head-averaged (all heads, equal weights)
            bucket-pooled attention of teacher and student at the sampled positions (64 per
            note, :func:`sample_positions`) of each layer pair.
        h_T: ``[pair, pos, d_T]`` (or one ``[pos, d_T]`` per pair), the teacher's hidden states
            at every trace position of the pairs' teacher layers.
        h_S: ``[pair, pos, d_S]`` (or one ``[pos, d_S]`` per pair), the student's at the pairs'
            student layers, aligned with ``h_T`` row by row.
        adapter: ``nn.Linear(d_S -> d_T)`` shared by the pairs, or one per pair
            (:func:`make_adapter`).
        attn_weight, hidden_weight: the two weights (1 and 1); a zero weight skips its term.
        eps: clamp of the attention distributions inside the KL; rms_eps: inside the RMS
            normalisation; hidden_chunk: positions per chunk of the hidden term.

    Returns ``(loss, parts)`` with
    ``loss = attn_weight * mean_{pair,pos_a} KL(a_T || a_S)
           + hidden_weight * mean_{pair,pos,d_T} (rms(h_T) - rms(adapter(h_S)))^2``,
    the KL as in :func:`attention_term` (rows without teacher mass left out; **[recon]**: the
    paper names "a KL divergence between the teacher's and the student's" attention, the
    direction teacher-to-student is the platform's, as in Mistill's attention term) and the
    hidden term from :func:`feature_kd_hidden_term`; parts ``attn``, ``hidden`` (detached,
    unweighted).
    """
    _check(a_T.dim() == 3 and a_T.shape == a_S.shape,
           f"a_T and a_S must both be [pair, pos, bucket], got {tuple(a_T.shape)} and "
           f"{tuple(a_S.shape)}", "a_S")
    hs = _pair_list(h_S, "h_S")
    _check(len(hs) == a_T.shape[0], "attention and hidden states have different pairs", "h_T")
    dtype = _compute_dtype(hs[0])
    attn = _mean_row_kl(a_T.reshape(-1, a_T.shape[-1]), a_S.reshape(-1, a_S.shape[-1]), eps)
    hidden = feature_kd_hidden_term(h_T, hs, adapter, chunk=hidden_chunk, eps=rms_eps)
    loss = _zero_like_graph(a_S, *hs).to(dtype)
    if attn_weight != 0:
        loss = loss + attn_weight * attn.to(dtype)
    if hidden_weight != 0:
        loss = loss + hidden_weight * hidden
    return loss, _detached_parts({"attn": attn, "hidden": hidden})


# ---------------------------------------------------------------------------------------------
# DistiLLM-2 (Ko et al., 2025)
# ---------------------------------------------------------------------------------------------

def _distillm2_chunk(s_flat: Tensor, t_flat: Tensor, rows: Tensor, *, alpha: float, kind: str,
                     detach_mixture: bool, dtype: torch.dtype) -> Tensor:
    """Per-token skew divergence at ``rows`` of ``[N, vocab]`` logits -> ``[len(rows)]``."""
    log_q = torch.log_softmax(s_flat.index_select(0, rows).to(dtype), dim=-1)
    log_p = torch.log_softmax(t_flat.index_select(0, rows).to(dtype), dim=-1)
    if kind == "skl":
        # D_KL(p || alpha p + (1 - alpha) q)
        log_mix = torch.logaddexp(math.log(alpha) + log_p, math.log1p(-alpha) + log_q)
        p = log_p.exp()
        safe = torch.where(p > 0, log_p, torch.zeros_like(log_p))
        return torch.where(p > 0, p * (safe - log_mix), torch.zeros_like(log_mix)).sum(-1)
    # D_KL(q || (1 - alpha) p + alpha q)
    q_in_mix = log_q.detach() if detach_mixture else log_q
    log_mix = torch.logaddexp(math.log1p(-alpha) + log_p, math.log(alpha) + q_in_mix)
    return (log_q.exp() * (log_q - log_mix)).sum(-1)


def _response_means(student_logits: Tensor, teacher_logits: Tensor, labels: Tensor, *,
                    kind: str, alpha: float, detach_mixture: bool, chunk: int,
                    ignore_index: int, field: str) -> tuple[Tensor, Tensor]:
    """Token mean of the skew divergence per response: ``([batch], n_tokens [batch])``."""
    if student_logits.dim() == 2:
        student_logits, teacher_logits = student_logits.unsqueeze(0), teacher_logits.unsqueeze(0)
        labels = labels.unsqueeze(0)
    _check(student_logits.dim() == 3, f"{field} logits must be [batch, pos, vocab] or "
           f"[pos, vocab], got {tuple(student_logits.shape)}", field)
    _check(student_logits.shape[-1] == teacher_logits.shape[-1],
           f"DistiLLM-2 needs a shared vocabulary: student {student_logits.shape[-1]} ids, "
           f"teacher {teacher_logits.shape[-1]}", "vocab")
    _check(student_logits.shape == teacher_logits.shape,
           f"{field}: student {tuple(student_logits.shape)} and teacher "
           f"{tuple(teacher_logits.shape)} logits differ in shape", field)
    _check(tuple(labels.shape) == tuple(student_logits.shape[:2]),
           f"{field}: labels {tuple(labels.shape)} do not match logits "
           f"{tuple(student_logits.shape[:2])}", field)
    batch, n_pos, vocab = student_logits.shape
    mask = labels.to(student_logits.device) != ignore_index
    counts = mask.sum(-1)
    _check(bool((counts > 0).all()), f"{field}: a response has no supervised token", field)
    dtype = _compute_dtype(student_logits)
    s_flat = student_logits.reshape(-1, vocab)
    t_flat = teacher_logits.detach().reshape(-1, vocab)
    flat_rows = mask.reshape(-1).nonzero().squeeze(-1)
    batch_of_row = flat_rows // n_pos
    fn = partial(_distillm2_chunk, alpha=alpha, kind=kind, detach_mixture=detach_mixture,
                 dtype=dtype)
    sums = _zero_like_graph(student_logits) + torch.zeros(batch, dtype=dtype,
                                                          device=student_logits.device)
    for start in range(0, flat_rows.shape[0], chunk):
        rows = flat_rows[start:start + chunk]
        if torch.is_grad_enabled() and s_flat.requires_grad:
            vals = checkpoint(fn, s_flat, t_flat, rows, use_reentrant=False)
        else:
            vals = fn(s_flat, t_flat, rows)
        sums = sums.index_add(0, batch_of_row[start:start + chunk], vals)
    return sums / counts.to(dtype), counts


def distillm2_loss(student_logits_pref: Tensor, teacher_logits_pref: Tensor, labels_pref: Tensor,
                   student_logits_dispref: Tensor, teacher_logits_dispref: Tensor,
                   labels_dispref: Tensor, *, alpha: float = DISTILLM2_ALPHA,
                   beta: float = DISTILLM2_BETA, detach_mixture: bool = True,
                   chunk: int = DEFAULT_LOGIT_CHUNK, ignore_index: int = IGNORE_INDEX,
                   ) -> tuple[Tensor, dict[str, Tensor]]:
    """DistiLLM-2's contrastive loss (CALD; Ko et al., 2025, "DistiLLM-2: A Contrastive Approach
    Boosts the Distillation of LLMs"), teacher trace preferred, the untrained student's own
    generation for the same prompt dispreferred.

    With ``p`` the teacher's and ``q`` the student's next-token distributions over the *shared*
    vocabulary and the skew divergences of DistiLLM (Ko et al., 2024)

    - ``SKL_a(p, q)  = KL(p || a p + (1 - a) q)``   (skew KL),
    - ``SRKL_a(p, q) = KL(q || (1 - a) p + a q)``   (skew reverse KL),

    each averaged over the supervised tokens of one response, the loss of a pair is

        ``l = (2 - beta) * mean_t SKL_alpha(p_t, q_t | y_pref)
              + beta * mean_t SRKL_alpha(p_t, q_t | y_dispref)``

    and the loss is the mean of ``l`` over pairs. SKL on the preferred (teacher-generated) trace
    raises the student's likelihood of it; SRKL on the dispreferred (student-generated) response
    lowers the student's mass where the teacher has little. The paper writes the balanced loss
    as ``1/(2|D|) sum [SKL(y_t) + SRKL(y_s)]``; the released trainer, which the paper's arm
    vendored at its published settings, sums the two terms per pair with coefficients
    ``(2 - beta, beta)``, ``beta = 1`` unless its gradual-beta curriculum is on, i.e. twice the
    paper's normalisation. We follow the released scale. Defaults (named constants):
    ``alpha = DISTILLM2_ALPHA = 0.1`` (both skews), ``beta = DISTILLM2_BETA = 1``. Not
    implemented: the paper's curriculum pieces, adaptive per-sample ``alpha`` and the gradual
    increase of ``beta``, both off in the released trainer's defaults (fixed alpha and beta can
    still be passed). ``detach_mixture=True`` (the released trainer's gradient) stops the
    gradient through the ``a q`` inside SRKL's mixture; the value is unchanged.

    Args:
        student_logits_pref, teacher_logits_pref: ``[batch, pos, vocab]`` (or ``[pos, vocab]``)
            on the teacher's trace; position ``t``'s logits score ``labels_pref[..., t]`` (the
            caller shifts).
        labels_pref: ``[batch, pos]`` (or ``[pos]``); ``ignore_index`` marks positions without
            loss (prompt, padding). Only the mask is read: the divergences are over the vocabulary.
        student_logits_dispref, teacher_logits_dispref, labels_dispref: the same on the student's
            generation; ``batch`` equal to the preferred side's (one dispreferred per pair).
        alpha: skew coefficient in (0, 1). beta: SRKL coefficient in [0, 2].
        chunk: supervised positions per chunk; each chunk's float32 vocabulary intermediates
            are recomputed in the backward (checkpoint).

    Raises ``MistillInputError`` (field ``vocab``) when the student's and teacher's vocabulary
    sizes differ: the loss is defined only on a shared vocabulary.

    Returns ``(loss, parts)``; parts (detached): ``skl`` and ``srkl`` (means over pairs of the
    per-response token means), ``n_pref``, ``n_dispref`` (supervised tokens).
    """
    _check(0.0 < alpha < 1.0, f"alpha must lie in (0, 1), got {alpha}", "alpha")
    _check(0.0 <= beta <= 2.0, f"beta must lie in [0, 2], got {beta}", "beta")
    _check(isinstance(chunk, int) and chunk >= 1, f"chunk must be a positive int, got {chunk!r}",
           "chunk")
    _check(student_logits_pref.shape[-1] == student_logits_dispref.shape[-1],
           "preferred and dispreferred logits have different vocabularies", "vocab")
    skl, n_pref = _response_means(student_logits_pref, teacher_logits_pref, labels_pref,
                                  kind="skl", alpha=alpha, detach_mixture=detach_mixture,
                                  chunk=chunk, ignore_index=ignore_index, field="pref")
    srkl, n_dis = _response_means(student_logits_dispref, teacher_logits_dispref,
                                  labels_dispref, kind="srkl", alpha=alpha,
                                  detach_mixture=detach_mixture, chunk=chunk,
                                  ignore_index=ignore_index, field="dispref")
    _check(skl.shape == srkl.shape, f"{skl.shape[0]} preferred and {srkl.shape[0]} "
           "dispreferred responses: one of each per pair", "dispref")
    loss = ((2.0 - beta) * skl + beta * srkl).mean()
    parts = {"skl": skl.mean(), "srkl": srkl.mean(),
             "n_pref": n_pref.sum().to(skl.dtype), "n_dispref": n_dis.sum().to(skl.dtype)}
    return loss, _detached_parts(parts)


__all__ = [
    "ATTENTION_EPS", "DEFAULT_LOGIT_CHUNK", "DEFAULT_MISTILL_TERMS", "DISTILLM2_ALPHA",
    "DISTILLM2_BETA", "EVENT_WEIGHT", "FEATURE_KD_ATTN_WEIGHT", "FEATURE_KD_HIDDEN_WEIGHT",
    "FEATURE_KD_HIDDEN_CHUNK", "FEATURE_KD_LAYER_MAPS", "FEATURE_KD_PAIRS", "FEATURE_KD_POSITIONS",
    "IGNORE_INDEX", "MISTILL_TERMS", "RMS_EPS",
    "TEACHER_TOP_K", "attention_term", "chunked_cot_loss", "distillm2_loss",
    "event_token_weights", "feature_kd_hidden_term", "feature_kd_loss", "interaction_term",
    "make_adapter",
    "mistill_objective", "rms_normalize", "sample_positions", "uniform_layer_pairs",
    "write_term",
]
