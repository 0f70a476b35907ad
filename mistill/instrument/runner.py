"""Forward passes against one note's key-value prefix: prefill once, then many small queries.

The instrument measures every decision with a forward of a few rows against the note's
prefix (the key-value cache of all earlier positions). :class:`Runner` owns those forwards,
written from the model's own parts (:mod:`mistill.models.geometry`), so that

- the prefix is built once per note by a chunked prefill into preallocated per-layer buffers
  (:class:`KVPrefix`); "cropping" to position ``p`` is choosing the view ``[:p]`` — the
  cache is never copied or grown;
- many single-token *variants* at one event run as one forward: they sit side by side on the
  row axis, share the position id, and each row sees the prefix plus only its own new key
  (``rows="own"``). The prefix part is computed once for all rows (query heads of one KV group
  folded into the row axis, so GQA needs no expanded keys) and merged with each row's own-key
  term through the log-sum-exp;
- continuations (``rows="causal"``) see the prefix and the earlier new rows (prefill chunks,
  the locus probe's suffix);
- several continuations cut at different positions of one note run as one forward: with
  ``batch_prefix_len`` each batch element sees only its own ``prefix[:len]`` plus its own earlier
  rows (the forcing probes of :mod:`mistill.instrument.locus`, the keys past the shortest cut on the exact math path);
- a batch of variants that only touches layers ``>= l`` can start from the clean residual
  stream at layer ``l`` (``start_layer``/``start_hidden``).

The head hook (:mod:`mistill.instrument.hooks`) fires inside every forward because ``o_proj``
is called as a module. On CUDA with bf16/fp16 weights the prefix part uses the flash-attention
kernel (with its log-sum-exp), also under gradients (its backward kernel plus the log-sum-exp's
share, :class:`_FlashPrefixAttention`); elsewhere, or with ``use_flash=False``, an exact float32
math path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mistill.models.geometry import HeadGeometry
from mistill.models.loading import LoadedModel


log = logging.getLogger("mistill.runner")


@dataclass
class KVPrefix:
    """Per-layer keys and values of one note, rotary already applied.

    ``keys[l]`` / ``values[l]``: ``[1, kv_head, max_pos, d_head]`` preallocated; positions
    ``[0, length)`` are visible to the next forward, ``[0, written)`` hold the prefill's keys.
    :meth:`crop` only moves ``length`` down; measurements never write into the buffers (only a
    prefill does, :meth:`Runner.forward` with ``write_prefix``), so :meth:`uncrop` may start a
    second sweep over the same note from its full length.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int
    input_ids: torch.Tensor  # [pos] the note's tokens
    written: int = 0

    def crop(self, length: int) -> None:
        if length > self.length:
            raise ValueError(f"crop to {length} > current length {self.length}: the prefix only shrinks")
        self.length = length

    def uncrop(self) -> None:
        """Make every position the prefill wrote visible again (a new sweep over the note)."""
        self.length = self.written

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() for k in self.keys) * 2


@dataclass
class RunnerOutput:
    """``logits``: ``[batch, row_out, vocab]`` (float32); ``hidden_in``: per layer the residual
    stream entering it, ``[layer, batch, row, d_model]`` when captured; ``final_hidden``: the
    residual stream entering the final norm at the logits rows, ``[batch, row_out, d_model]``,
    captured with ``hidden_in``."""

    logits: torch.Tensor
    hidden_in: torch.Tensor | None = None
    final_hidden: torch.Tensor | None = None


_HAS_FLASH_OP = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention")


def _flash_available(t: torch.Tensor) -> bool:
    return t.is_cuda and t.dtype in (torch.float16, torch.bfloat16) and _HAS_FLASH_OP


_KEY_CHUNK = 16384


def _chunk_scores(q32: torch.Tensor, k: torch.Tensor, start: int, stop: int, scale: float,
                  row_limit: torch.Tensor | None) -> torch.Tensor:
    """Scores ``[kv_head, row, chunk]`` of float32 queries against keys ``[start, stop)``."""
    s = torch.matmul(q32, k[:, start:stop].float().transpose(-1, -2)) * scale
    if row_limit is not None:
        idx = torch.arange(start, stop, device=q32.device).unsqueeze(0)
        s = s.masked_fill((idx >= row_limit.unsqueeze(1)).unsqueeze(0), float("-inf"))
    return s


class _MathPrefixAttention(torch.autograd.Function):
    """Exact attention over the prefix in float32, chunked over keys (online softmax).

    Returns ``out`` and ``lse``; the backward recomputes the scores chunk by chunk, so nothing of
    size ``[row, pos]`` is kept, and gives ``d/dq`` for gradients reaching ``out`` and ``lse``.
    Keys and values are the (gradient-free) prefix buffers.
    """

    @staticmethod
    def forward(ctx, q, k, v, scale, row_limit):
        q32 = q.float()
        kvh, rows, d = q32.shape
        lse = torch.full((kvh, rows), float("-inf"), dtype=torch.float32, device=q.device)
        acc = torch.zeros(kvh, rows, d, dtype=torch.float32, device=q.device)
        for start in range(0, k.shape[1], _KEY_CHUNK):
            stop = min(k.shape[1], start + _KEY_CHUNK)
            s = _chunk_scores(q32, k, start, stop, scale, row_limit)
            chunk_lse = torch.logsumexp(s, dim=-1)
            new_lse = torch.logaddexp(lse, chunk_lse)
            keep = torch.exp(lse - new_lse).nan_to_num(0.0)
            p = torch.exp(s - new_lse.unsqueeze(-1)).nan_to_num(0.0)
            acc = acc * keep.unsqueeze(-1) + torch.matmul(p, v[:, start:stop].float())
            lse = new_lse
        ctx.save_for_backward(q32, k, v, acc, lse, row_limit if row_limit is not None else torch.empty(0))
        ctx.scale = scale
        ctx.has_limit = row_limit is not None
        return acc, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q32, k, v, out, lse, row_limit = ctx.saved_tensors
        row_limit = row_limit if ctx.has_limit else None
        grad_out = torch.zeros_like(out) if grad_out is None else grad_out.float()
        grad_lse = torch.zeros_like(lse) if grad_lse is None else grad_lse.float()
        delta = (grad_out * out).sum(-1) - grad_lse  # [kv_head, row]
        dq = torch.zeros_like(q32)
        for start in range(0, k.shape[1], _KEY_CHUNK):
            stop = min(k.shape[1], start + _KEY_CHUNK)
            s = _chunk_scores(q32, k, start, stop, ctx.scale, row_limit)
            p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
            dp = torch.matmul(grad_out, v[:, start:stop].float().transpose(-1, -2))
            ds = p * (dp - delta.unsqueeze(-1))
            dq = dq + torch.matmul(ds, k[:, start:stop].float()) * ctx.scale
        return dq, None, None, None, None


def lse_grad_q(q: torch.Tensor, k: torch.Tensor, grad_lse: torch.Tensor, scale: float, attend) -> torch.Tensor:
    """The log-sum-exp's share of ``d/dq``: ``d lse_r / d q_r = scale * sum_j p_rj k_j``, the
    attention output with the keys as values, so ``scale * grad_lse * attend(q, k, k)``.

    Args:
        q: ``[kv_head, row, d_head]``; k: ``[kv_head, pos, d_head]``; grad_lse: ``[kv_head, row]``.
        attend: ``(q, k, v) -> out`` ``[kv_head, row, d_head]``, the attention of ``q`` over ``k``.
    """
    return scale * grad_lse.float().unsqueeze(-1) * attend(q, k, k).float()


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    return torch.ops.aten._scaled_dot_product_flash_attention(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), 0.0, False, False, scale=scale)


class _FlashPrefixAttention(torch.autograd.Function):
    """Attention over the prefix with the flash kernel, differentiable in ``q`` (CUDA, bf16/fp16).

    The backward runs the flash backward kernel for the gradient reaching ``out`` and adds the
    log-sum-exp's share (:func:`lse_grad_q`, one more flash forward with the keys as values), so
    a merge of the prefix part with the rows' own keys through the lse is differentiated
    exactly (to the kernel's rounding). Keys and values are gradient-free prefix buffers.
    """

    @staticmethod
    def forward(ctx, q, k, v, scale):
        res = _flash(q, k, v, scale)
        out, lse = res[0], res[1]
        ctx.save_for_backward(q, k, v, out, lse, res[2], res[3], res[6], res[7])
        ctx.scale, ctx.max_q, ctx.max_k = scale, res[4], res[5]
        return out[0].float(), lse[0].float()

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, cum_q, cum_k, seed, offset = ctx.saved_tensors
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        if grad_out is not None:
            dq = dq + torch.ops.aten._scaled_dot_product_flash_attention_backward(
                grad_out.to(q.dtype).unsqueeze(0), q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), out, lse,
                cum_q, cum_k, ctx.max_q, ctx.max_k, 0.0, False, seed, offset, scale=ctx.scale)[0][0].float()
        if grad_lse is not None:
            dq = dq + lse_grad_q(q, k, grad_lse, ctx.scale, lambda a, b, c: _flash(a, b, c, ctx.scale)[0][0])
        return dq.to(q.dtype), None, None, None


def prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     *, use_flash: bool | None = None, row_limit: torch.Tensor | None = None,
                     kernel: str = "flash") -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of folded query rows over a shared prefix, with its log-sum-exp.

    Args:
        q: ``[kv_head, row, d_head]`` (query heads of a KV group folded into ``row``).
        k, v: ``[kv_head, pos, d_head]`` (views into the prefix buffers).
        row_limit: optional ``[row]``: row ``r`` sees only keys ``< row_limit[r]``; the keys below
            the smallest limit, which every row sees, take the unmasked path (flash where
            allowed), the rest the masked math path, merged through the log-sum-exp.
        kernel: the fused kernel of the unmasked path without gradients where ``use_flash``:
            ``"flash"`` or ``"cudnn"`` (faster on Hopper for the long blocks of a prefill; it
            plans per shape, so the short rows of measurements stay on flash).
    Returns:
        ``out`` ``[kv_head, row, d_head]`` (float32) and ``lse`` ``[kv_head, row]`` (float32).
    """
    if k.shape[1] == 0:
        return (torch.zeros(q.shape, dtype=torch.float32, device=q.device),
                torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device))
    if use_flash is None:
        use_flash = _flash_available(q)
    if row_limit is not None:
        # keys every row sees run unmasked (the flash kernel where allowed); only the keys past
        # the shortest limit take the masked math path; the two parts merge through the lse
        common = min(int(row_limit.min()), k.shape[1])
        if common >= k.shape[1]:
            return prefix_attention(q, k, v, scale, use_flash=use_flash)
        if common > 0:
            out_c, lse_c = prefix_attention(q, k[:, :common], v[:, :common], scale, use_flash=use_flash)
            out_t, lse_t = _MathPrefixAttention.apply(q, k[:, common:], v[:, common:], scale, row_limit - common)
            lse = torch.logaddexp(lse_c, lse_t)
            out = (out_c * torch.exp(lse_c - lse).unsqueeze(-1)
                   + out_t * torch.exp(lse_t - lse).nan_to_num(0.0).unsqueeze(-1))
            return out, lse
        return _MathPrefixAttention.apply(q, k, v, scale, row_limit)
    if use_flash and torch.is_grad_enabled() and q.requires_grad:
        return _FlashPrefixAttention.apply(q, k, v, scale)
    if use_flash and kernel == "cudnn":
        return _cudnn_prefix(q, k, v, scale)
    if use_flash:
        res = _flash(q, k, v, scale)
        return res[0][0].float(), res[1][0].float()
    return _MathPrefixAttention.apply(q, k, v, scale, row_limit)


NO_ROWS = torch.empty(0, dtype=torch.long)
"""``logits_rows`` of a prefill chunk whose logits nobody asked for (no ``[row, vocab]`` head)."""

GQA_FLASH: bool | None = None
"""Whether the flash kernel takes fewer key heads than query heads (found on first use)."""

CUDNN_PREFIX: bool | None = None
"""Whether cuDNN's fused attention gives the prefix part of a prefill (checked once, on a small
case against flash; False where the build lacks it)."""


def _cudnn_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`prefix_attention`'s unmasked path through cuDNN: ``out`` ``[kv_head, row, d_head]``
    and ``lse`` ``[kv_head, row]``, float32."""
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), None,
                                                             True, 0.0, False, False, scale=scale)
    return res[0][0].float(), res[1][0].reshape(q.shape[0], q.shape[1]).float()


def _cudnn_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of a square block (rows and keys at the same positions) through cuDNN.

    cuDNN aligns its causal mask to the top left, which for a square block is the lower-right
    alignment a chunk's own rows need.

    Args:
        q, k, v: ``[batch, head, row, d_head]`` (key heads repeated to the query heads).
    Returns:
        ``out`` ``[batch, head, row, d_head]`` and ``lse`` ``[batch, head, row]``, float32.
    """
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=scale)
    return res[0].float(), res[1].reshape(q.shape[:3]).float()


def cudnn_prefix_usable(like: torch.Tensor) -> bool:
    """Whether :func:`_cudnn_prefix` and :func:`_cudnn_causal` run here and agree with flash (out
    and lse) on random inputs of ``like``'s device and dtype; found once per process."""
    global CUDNN_PREFIX
    if CUDNN_PREFIX is None:
        gen = torch.Generator(device=like.device).manual_seed(0)
        q, k, v = (torch.randn(2, n, 128, device=like.device, dtype=like.dtype, generator=gen) for n in (96, 320, 320))
        try:
            out_c, lse_c = _cudnn_prefix(q, k, v, 0.1)
            out_s, lse_s = _cudnn_causal(k[None], k[None], v[None], 0.1)
        except (RuntimeError, TypeError):
            CUDNN_PREFIX = False
            return False
        res = _flash(q, k, v, 0.1)
        ref = torch.ops.aten._scaled_dot_product_flash_attention(k[None], k[None], v[None], 0.0, True, False, scale=0.1)
        CUDNN_PREFIX = bool((out_c - res[0][0].float()).abs().max() < 1e-2
                            and (lse_c - res[1][0].float()).abs().max() < 1e-3
                            and (out_s - ref[0].float()).abs().max() < 1e-2
                            and (lse_s - ref[1].float()).abs().max() < 1e-3)
    return CUDNN_PREFIX


def causal_over_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of a prefill chunk's rows over the prefix and the chunk, one flash call.

    Args:
        q: ``[1, head, row, d_head]``; k, v: ``[1, kv_head, pos, d_head]`` where the last ``row``
            key positions are the chunk's own (lower-right causal alignment: row ``r`` sees keys
            ``< pos - row + r + 1``).
    Returns:
        ``[1, row, head, d_head]`` in ``q``'s dtype.
    """
    global GQA_FLASH
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and GQA_FLASH is not False:
        try:
            out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)[0]
            GQA_FLASH = True
            return out.transpose(1, 2)
        except RuntimeError:
            GQA_FLASH = False
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)[0].transpose(1, 2)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm of the supported families, op for op: float32 statistics, the
    normalised input cast back before the weight multiplies it."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class FusedElementwise:
    """The element-wise work of a layer (the RMS norms, the rotary embedding) compiled into fused
    kernels by ``torch.compile`` (Triton), for the prefill's long chunks on CUDA, where that work
    otherwise runs as a dozen memory-bound kernels per layer. Compiled once per process, for any
    chunk length (dynamic shapes); a norm that is not transformers' plain RMSNorm runs as is."""

    def __init__(self, apply_rope) -> None:
        self.norm_fn = torch.compile(_rms_norm, dynamic=True)
        self.rope_fn = torch.compile(apply_rope, dynamic=True)

    def norm(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        eps = getattr(module, "variance_epsilon", None)
        if eps is None or not type(module).__name__.endswith("RMSNorm") or getattr(module, "weight", None) is None:
            return module(x)
        return self.norm_fn(x, module.weight, eps)

    def rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        return self.rope_fn(q, k, cos, sin)


FUSED: dict[int, FusedElementwise | None] = {}
"""The compiled element-wise parts per rotary function (None where compiling failed)."""


PREFILL_KERNELS = ("auto", "cudnn", "flash", "split")
"""How a prefill chunk attends on CUDA (bf16/fp16): ``cudnn``, the prefix and the chunk's own
causal block each through cuDNN's kernel, merged through the log-sum-exp;
``flash``, one causal flash call over prefix + chunk (:func:`causal_over_prefix`); ``split``,
as ``cudnn`` with flash for both parts; ``auto``, ``cudnn`` where :func:`cudnn_prefix_usable`,
else ``flash``. Measured at Qwen3-14B @ 106k on an H200, chunks of 8,192: ``cudnn`` 14.2 s
(13.3 s with :class:`FusedElementwise`), ``flash`` 18.9 s (``benchmarks/RESULTS.md``). Elsewhere (CPU,
float32) the exact math path."""


class Runner:
    """Prefill and row forwards for one model (see the module docstring)."""

    def __init__(self, lm: LoadedModel, *, chunk_size: int = 8192, use_flash: bool | None = None) -> None:
        self.lm = lm
        self.geometry: HeadGeometry = lm.geometry
        self.chunk_size = chunk_size
        # None: the flash kernel on CUDA (bf16/fp16), with or without gradients; False: always the math path
        self.use_flash = use_flash
        self.prefill_kernel = "auto"  # one of PREFILL_KERNELS
        # the prefill's norms and rotary embedding through compiled fused kernels on CUDA
        # (:class:`FusedElementwise`); False: the model's own modules everywhere
        self.fuse_elementwise = True
        lm.model.requires_grad_(False)

    @property
    def device(self) -> torch.device:
        return self.geometry.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.geometry.embed.weight.dtype

    # -- prefix ----------------------------------------------------------------------------
    def new_prefix(self, input_ids: torch.Tensor, max_len: int | None = None) -> KVPrefix:
        g = self.geometry
        n = max_len or int(input_ids.numel())
        shape = (1, g.n_kv_heads, n, g.d_head)
        return KVPrefix(keys=[torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(g.n_layers)],
                        values=[torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(g.n_layers)],
                        length=0, input_ids=input_ids.to(self.device))

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, *, logits_at: torch.Tensor | None = None) -> tuple[KVPrefix, torch.Tensor | None]:
        """Build the note's prefix in chunks; the hook sees every position once.

        Args:
            input_ids: ``[pos]`` token ids of prompt + trace.
            logits_at: optional ``[row]`` positions whose next-token logits to return.
        Returns:
            The prefix (length = ``pos``) and ``[row, vocab]`` float32 logits or ``None``.
        """
        ids = input_ids.to(self.device).long()
        prefix = self.new_prefix(ids)
        total = ids.numel()
        want = None if logits_at is None else torch.as_tensor(logits_at, device=self.device).long()
        out_logits = None if want is None else torch.empty(want.numel(), self.geometry.vocab,
                                                           dtype=torch.float32, device=self.device)
        for start in range(0, total, self.chunk_size):
            end = min(total, start + self.chunk_size)
            rows = None
            sel = None
            if want is not None:
                sel = ((want >= start) & (want < end)).nonzero().flatten()
                rows = (want[sel] - start) if sel.numel() else None
            res = self.forward(prefix, start, ids[start:end].unsqueeze(0),
                               torch.arange(start, end, device=self.device), rows="causal",
                               logits_rows=rows if rows is not None else NO_ROWS, write_prefix=True)
            if rows is not None:
                out_logits[sel] = res.logits[0]
        return prefix, out_logits

    # -- row forwards ------------------------------------------------------------------------
    def forward(self, prefix: KVPrefix, prefix_len: int, token_ids: torch.Tensor,
                position_ids: torch.Tensor, *, rows: str = "own",
                logits_rows: torch.Tensor | None = None, start_layer: int = 0,
                start_hidden: torch.Tensor | None = None, capture_hidden: bool = False,
                write_prefix: bool = False, row_prefix_len: torch.Tensor | None = None,
                batch_prefix_len: torch.Tensor | None = None, own_tail: int = 0,
                long_rows: bool = False) -> RunnerOutput:
        """Run ``token_ids`` ``[batch, row]`` against ``prefix[:prefix_len]``.

        Args:
            position_ids: ``[row]`` or ``[batch, row]`` rotary positions.
            rows: ``"own"`` — each row sees the prefix and its own key only (variants);
                ``"causal"`` — rows see the prefix and earlier rows (continuations).
            logits_rows: ``[row_out]`` rows whose logits to compute (default: all).
            start_layer, start_hidden: begin at layer ``l`` from the residual stream
                ``[batch, row, d_model]`` entering it (rows where earlier layers are clean).
            capture_hidden: also return the residual stream entering every layer.
            write_prefix: store the rows' keys/values at ``[prefix_len, prefix_len+row)``
                (prefill; batch must be 1) and set ``prefix.length`` to the end.
            row_prefix_len: ``[row]`` with ``rows="own"``: row ``r`` sees only
                ``prefix[:row_prefix_len[r]]`` (several events of one note in one forward, each
                exactly as its own single-token forward; keys past the smallest limit on the exact math path).
            batch_prefix_len: ``[batch]`` with ``rows="causal"``: batch element ``b`` sees only
                ``prefix[:batch_prefix_len[b]]`` (each ``<= prefix_len``) and its own earlier rows
                (continuations cut at different positions, each exactly as its own forward
                against the cropped prefix; keys past the shortest prefix on the exact math path).
            own_tail: with ``rows="causal"``, the last ``own_tail`` rows see the prefix, the rows
                before them and their own key, not each other: several reads of one
                continuation's next token in one forward (e.g. plain and with heads patched).
            long_rows: with ``rows="causal"``, the rows are many (re-fed spans of a few hundred
                tokens and more): on CUDA their prefix part takes the prefill's kernel
                (:data:`PREFILL_KERNELS`) instead of flash.
        """
        g = self.geometry
        if prefix_len > prefix.length:
            raise ValueError(f"prefix_len {prefix_len} beyond the prefix ({prefix.length})")
        token_ids = token_ids.to(self.device)
        B, n = token_ids.shape
        if own_tail and (rows != "causal" or write_prefix or not 0 < own_tail < n):
            raise ValueError("own_tail needs rows='causal', no write_prefix and fewer tail rows than rows")
        pos = position_ids.to(self.device).long()
        if pos.dim() == 1:
            pos = pos.unsqueeze(0).expand(B, n)
        if start_hidden is not None:
            h = start_hidden.to(self.device, self.dtype)
        else:
            h = g.embed(token_ids)
            start_layer = 0
        cos, sin = g.rotary(h, pos)
        row_limit = None
        if row_prefix_len is not None:
            if rows != "own":
                raise ValueError("row_prefix_len needs rows='own'")
            lim = torch.as_tensor(row_prefix_len, device=self.device).long()
            # folded rows are ordered (batch, row, group): repeat each row's limit per batch and group
            row_limit = lim.view(1, n, 1).expand(B, n, g.n_groups).reshape(-1)
        if batch_prefix_len is not None:
            if rows != "causal" or row_limit is not None:
                raise ValueError("batch_prefix_len needs rows='causal' and no row_prefix_len")
            lim = torch.as_tensor(batch_prefix_len, device=self.device).long().reshape(-1)
            if lim.numel() != B:
                raise ValueError(f"batch_prefix_len has {lim.numel()} entries for a batch of {B}")
            if B and int(lim.max()) > prefix_len:
                raise ValueError(f"batch_prefix_len {int(lim.max())} beyond prefix_len {prefix_len}")
            # folded rows are ordered (batch, row, group): repeat each element's limit per row and group
            row_limit = lim.view(B, 1, 1).expand(B, n, g.n_groups).reshape(-1)
        captured = [] if capture_hidden else None
        kernel = "flash"
        if (rows == "causal" and (write_prefix or long_rows) and row_limit is None and B * n > 0 and prefix_len > 0
                and self.use_flash is not False and _flash_available(h) and not torch.is_grad_enabled()):
            kernel = self._prefill_kernel(h)
        one_kernel = kernel == "one_flash" and write_prefix and B == 1
        fused = self._fused(h) if rows == "causal" and (write_prefix or long_rows) and B * n > 0 else None
        norm = fused.norm if fused is not None else (lambda module, x: module(x))
        rope = fused.rope if fused is not None else g.apply_rope
        for parts in g.layers[start_layer:]:
            if captured is not None:
                captured.append(h)
            l = parts.index
            x = norm(parts.input_norm, h)
            q = parts.q_proj(x).view(B, n, g.n_heads, g.d_head)
            k = parts.k_proj(x).view(B, n, g.n_kv_heads, g.d_head)
            v = parts.v_proj(x).view(B, n, g.n_kv_heads, g.d_head)
            if parts.q_norm is not None:
                q = norm(parts.q_norm, q)
                k = norm(parts.k_norm, k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [batch, head, row, d_head]
            if parts.use_rope:
                q, k = rope(q, k, cos, sin)
            if write_prefix and one_kernel:
                # a prefill chunk: its keys join the prefix, then one causal flash call over
                # prefix + chunk, aligned to the last key (row r sees keys <= prefix_len + r)
                prefix.keys[l][:, :, prefix_len:prefix_len + n] = k
                prefix.values[l][:, :, prefix_len:prefix_len + n] = v
                attn = causal_over_prefix(q, prefix.keys[l][:, :, :prefix_len + n],
                                          prefix.values[l][:, :, :prefix_len + n], parts.scaling)
            else:
                kp = prefix.keys[l][0, :, :prefix_len]
                vp = prefix.values[l][0, :, :prefix_len]
                attn = self._attend(q, k, v, kp, vp, parts.scaling, rows, row_limit,
                                    prefix_kernel=kernel, own_tail=own_tail)  # [batch, row, head, d_head]
                if write_prefix:
                    prefix.keys[l][:, :, prefix_len:prefix_len + n] = k
                    prefix.values[l][:, :, prefix_len:prefix_len + n] = v
            h = h + parts.o_proj(attn.reshape(B, n, g.n_heads * g.d_head))
            h = h + parts.mlp(norm(parts.post_norm, h))
        if write_prefix:
            prefix.length = prefix.written = prefix_len + n
        hs = h if logits_rows is None else h[:, torch.as_tensor(logits_rows, device=self.device).long()]
        logits = g.lm_head(g.final_norm(hs)).float()
        hidden = None
        if captured is not None:
            hidden = torch.stack(captured, dim=0)
        return RunnerOutput(logits=logits, hidden_in=hidden, final_hidden=hs if captured is not None else None)

    def _fused(self, like: torch.Tensor) -> FusedElementwise | None:
        """The compiled element-wise parts when ``fuse_elementwise`` is on, ``like`` is on CUDA
        and nothing needs gradients; None otherwise, or where compiling fails (said once)."""
        if not self.fuse_elementwise or like.device.type != "cuda" or torch.is_grad_enabled():
            return None
        key = id(self.geometry.apply_rope)
        if key not in FUSED:
            try:
                fused = FusedElementwise(self.geometry.apply_rope)
                x = torch.randn(2, 3, 8, 16, device=like.device, dtype=like.dtype)
                fused.norm_fn(x, torch.ones(16, device=like.device, dtype=like.dtype), 1e-6)
                fused.rope_fn(x, x, x[:, 0], x[:, 0])
                FUSED[key] = fused
            except Exception as err:  # noqa: BLE001 - any compiler failure falls back to the modules
                log.warning("fused element-wise kernels unavailable (%s); the model's modules run", err)
                FUSED[key] = None
        return FUSED[key]

    def _prefill_kernel(self, like: torch.Tensor) -> str:
        """The prefix kernel of a CUDA prefill chunk: ``"cudnn"``, ``"flash"`` (split) or
        ``"one_flash"`` (:data:`PREFILL_KERNELS`)."""
        choice = self.prefill_kernel
        if choice not in PREFILL_KERNELS:
            raise ValueError(f"prefill_kernel must be one of {PREFILL_KERNELS}, not {choice!r}")
        if choice == "auto":
            choice = "cudnn" if cudnn_prefix_usable(like) else "flash"
        return {"cudnn": "cudnn", "flash": "one_flash", "split": "flash"}[choice]

    def _attend(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                kp: torch.Tensor, vp: torch.Tensor, scale: float, rows: str,
                row_limit: torch.Tensor | None = None, *, prefix_kernel: str = "flash",
                own_tail: int = 0) -> torch.Tensor:
        """Attention of new rows over prefix + new keys.

        Args:
            q: ``[batch, head, row, d_head]``; k_new, v_new: ``[batch, kv_head, row, d_head]``;
            kp, vp: ``[kv_head, pos, d_head]``.
            own_tail: causal rows only; the last ``own_tail`` rows see the rows before them and
                their own key (:meth:`forward`).
        Returns:
            ``[batch, row, head, d_head]`` in the model dtype.
        """
        B, H, n, d = q.shape
        KV = k_new.shape[1]
        G = H // KV
        if rows == "causal" and kp.shape[1] == 0 and row_limit is None:
            # nothing before these rows (a prefill in one chunk): the fused causal kernel
            out = F.scaled_dot_product_attention(q, k_new, v_new, is_causal=True, scale=scale,
                                                 enable_gqa=G > 1)
            return out.transpose(1, 2)
        # prefix part, query heads folded per KV head: rows ordered (batch, row, group)
        qf = q.reshape(B, KV, G, n, d).permute(1, 0, 3, 2, 4).reshape(KV, B * n * G, d)
        flash = None if self.use_flash is None else (self.use_flash and _flash_available(q))
        out_p, lse_p = prefix_attention(qf, kp, vp, scale, use_flash=flash, row_limit=row_limit,
                                        kernel=prefix_kernel)
        out_p = out_p.view(KV, B, n, G, d).permute(1, 0, 3, 2, 4)  # [batch, kv_head, group, row, d_head], a view
        lse_p = lse_p.view(KV, B, n, G).permute(1, 0, 3, 2).reshape(B, H, n)
        fused_block = (rows == "causal" and n - own_tail > 1 and self.use_flash is not False
                       and not torch.is_grad_enabled() and _flash_available(q))
        if not fused_block or own_tail:  # float32 copies for the math paths (a fused block alone needs none)
            k_rep = k_new.repeat_interleave(G, dim=1).float()
            v_rep = v_new.repeat_interleave(G, dim=1).float()
            qf32 = q.float()
        if rows == "own":
            lse_n = (qf32 * k_rep).sum(-1) * scale  # [batch, head, row]
            out_n = v_rep
        elif rows == "causal":
            m = n - own_tail
            if fused_block:
                ks, vs = k_new[:, :, :m].repeat_interleave(G, dim=1), v_new[:, :, :m].repeat_interleave(G, dim=1)
                if prefix_kernel == "cudnn":  # a prefill chunk's own block: square, so cuDNN's alignment holds
                    out_n, lse_n = _cudnn_causal(q[:, :, :m], ks, vs, scale)
                else:
                    res = torch.ops.aten._scaled_dot_product_flash_attention(q[:, :, :m], ks, vs, 0.0, True, False,
                                                                             scale=scale)
                    out_n, lse_n = res[0].float(), res[1].float()
            else:
                s = torch.matmul(qf32[:, :, :m], k_rep[:, :, :m].transpose(-1, -2)) * scale  # [batch, head, m, m]
                causal = torch.ones(m, m, dtype=torch.bool, device=q.device).tril()
                s = s.masked_fill(~causal, float("-inf"))
                lse_n = torch.logsumexp(s, dim=-1)
                out_n = torch.matmul(torch.exp(s - lse_n.unsqueeze(-1)), v_rep[:, :, :m])
            if own_tail:
                # each tail row: the m rows before the tail, then its own key
                qt = qf32[:, :, m:]
                s = torch.cat([torch.matmul(qt, k_rep[:, :, :m].transpose(-1, -2)),
                               (qt * k_rep[:, :, m:]).sum(-1, keepdim=True)], dim=-1) * scale
                # s: [batch, head, tail, m + 1]
                lse_t = torch.logsumexp(s, dim=-1)
                p = torch.exp(s - lse_t.unsqueeze(-1))
                out_t = torch.matmul(p[..., :m], v_rep[:, :, :m]) + p[..., m:] * v_rep[:, :, m:]
                out_n, lse_n = torch.cat([out_n, out_t], dim=2), torch.cat([lse_n, lse_t], dim=2)
        else:
            raise ValueError(f"rows must be 'own' or 'causal', not {rows!r}")
        lse = torch.logaddexp(lse_p, lse_n)
        # merged in float32 over [batch, kv_head, group, row, d_head] views, written once into the
        # [batch, row, head, d_head] layout the output projection reads (no copies of the parts)
        merged = out_p * torch.exp(lse_p - lse).view(B, KV, G, n, 1)
        merged.addcmul_(out_n.unflatten(1, (KV, G)), torch.exp(lse_n - lse).view(B, KV, G, n, 1))
        out = torch.empty(B, n, H, d, dtype=q.dtype, device=q.device)
        out.view(B, n, KV, G, d).permute(0, 2, 3, 1, 4).copy_(merged)
        return out
