"""bf16 training on a CPU: where the bf16 matmuls run.

A bf16 GEMM multiplies bf16 operands, accumulates in fp32 and rounds the result to bf16. CPUs
with AVX512-BF16 or AMX (x86) or the BF16 extension (Arm) do this in hardware; on the others
torch's kernels convert the operands block by block and run about 3x slower than an fp32 GEMM of
the same shape (measured on an AVX-512F Xeon, ``benchmarks/RESULTS.md``). Converting the operands
once (bf16 -> fp32 is exact), running the fp32 GEMM and rounding the product to bf16 is the same
arithmetic (the same products, fp32 accumulation, one rounding of the result) in another
summation order, which float kernels never fix anyway. :func:`fp32_gemms` does that for every
``nn.Linear`` and for the attention kernel of a bf16 model on the CPU; weights, activations and
gradients stay bf16 (each cast's backward rounds the fp32 gradient to bf16, as the bf16 kernel's
output does).

Modes (``RecipeParams.cpu_bf16_matmul``): ``native`` (torch's bf16 kernels), ``fp32`` (always
on the CPU), ``auto`` (fp32 where the CPU lacks bf16 instructions). CUDA is never touched.
"""

from __future__ import annotations

import platform
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

MODES = ("auto", "native", "fp32")
ATTENTION = "mistill_cpu_fp32_sdpa"
# CPU flags (Linux /proc/cpuinfo) that mean bf16 GEMMs run in hardware
_X86_FLAGS = ("avx512_bf16", "amx_bf16")
_ARM_FLAGS = ("bf16",)


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (``flags`` on x86, ``Features`` on Arm);
    empty where the file is absent (not Linux)."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        if not path.exists():
            return set()
        cpuinfo = path.read_text(errors="replace")
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            return set(value.split())
    return set()


def native_bf16(flags: set[str] | None = None, machine: str | None = None) -> bool:
    """Whether this CPU runs bf16 GEMMs in hardware. Where the flags cannot be read (not Linux)
    the answer is True, so ``auto`` leaves torch's kernels alone there."""
    flags = cpu_flags() if flags is None else flags
    if not flags:
        return True
    machine = (machine or platform.machine()).lower()
    wanted = _ARM_FLAGS if machine in ("aarch64", "arm64") else _X86_FLAGS
    return any(f in flags for f in wanted)


def use_fp32_gemms(mode: str, device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether :func:`fp32_gemms` applies: a bf16 model on the CPU, in mode ``fp32``, or in
    ``auto`` on a CPU without bf16 instructions."""
    if mode not in MODES:
        raise ValueError(f"cpu_bf16_matmul must be one of {MODES}, not {mode!r}")
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16 or mode == "native":
        return False
    return mode == "fp32" or not native_bf16()


def uses_fp32_gemms(model: nn.Module) -> bool:
    """Whether :func:`fp32_gemms` changed any layer of ``model``."""
    return any(getattr(m, "_mistill_fp32_gemm", False) for m in model.modules())


def _linear_forward(layer: nn.Linear):
    def forward(x: torch.Tensor) -> torch.Tensor:
        bias = None if layer.bias is None else layer.bias.float()
        return F.linear(x.float(), layer.weight.float(), bias).to(x.dtype)
    return forward


def _fp32_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, **kwargs):
    """transformers' SDPA attention on fp32 copies of ``query``/``key``/``value``
    (``[batch, heads, pos, d_head]``), the output rounded back to their dtype."""
    # deferred: transformers.integrations.sdpa_attention is slow to import
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask,
                                          **kwargs)
    return out.to(query.dtype), weights


def _register_attention() -> None:
    from transformers import AttentionInterface  # deferred: transformers is slow to import

    AttentionInterface.register(ATTENTION, _fp32_sdpa)


def fp32_gemms(model: nn.Module) -> int:
    """Run every ``nn.Linear`` of ``model`` and its SDPA attention as fp32 GEMMs on upcast
    operands (see the module docstring). Idempotent; returns the number of linear layers
    changed. Attention changes only where the model uses SDPA."""
    n = 0
    for layer in model.modules():
        if isinstance(layer, nn.Linear) and not getattr(layer, "_mistill_fp32_gemm", False):
            layer.forward = _linear_forward(layer)
            layer._mistill_fp32_gemm = True
            n += 1
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "_attn_implementation", None) == "sdpa":
        _register_attention()
        for sub in model.modules():  # the model and its sub-models share or copy the config
            cfg = getattr(sub, "config", None)
            if cfg is not None and getattr(cfg, "_attn_implementation", None) == "sdpa":
                cfg._attn_implementation = ATTENTION
    return n


__all__ = ["MODES", "cpu_flags", "native_bf16", "use_fp32_gemms", "uses_fp32_gemms", "fp32_gemms"]
