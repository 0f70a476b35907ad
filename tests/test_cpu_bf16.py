"""bf16 matmuls on the CPU as fp32 GEMMs on upcast operands: the same arithmetic as a bf16
GEMM (every entry within one bf16 rounding of the exact product), bf16 weights and gradients,
nothing of it in a saved checkpoint, and the modes' resolution."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from mistill.distill.cpu_bf16 import ATTENTION, cpu_flags, fp32_gemms, native_bf16, use_fp32_gemms, uses_fp32_gemms
from mistill.distill.trainer import RecipeConfig, prepare_student
from mistill.errors import MistillInputError
from mistill.models.loading import tiny_model

X86_NO_BF16 = "processor\t: 0\nflags\t\t: fpu sse sse2 avx2 avx512f avx512bw avx512_vnni\n"
X86_BF16 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n"
X86_AMX = "processor\t: 0\nflags\t\t: avx512f amx_tile amx_bf16 amx_int8\n"
ARM_BF16 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"
ARM_NO_BF16 = "processor\t: 0\nFeatures\t: fp asimd evtstrm crc32\n"


def test_cpu_flags_and_native_bf16():
    assert "avx512_bf16" in cpu_flags(X86_BF16) and "avx512f" in cpu_flags(X86_NO_BF16)
    assert not native_bf16(cpu_flags(X86_NO_BF16), "x86_64")
    assert native_bf16(cpu_flags(X86_BF16), "x86_64") and native_bf16(cpu_flags(X86_AMX), "x86_64")
    assert native_bf16(cpu_flags(ARM_BF16), "aarch64") and not native_bf16(cpu_flags(ARM_NO_BF16), "aarch64")
    # no flags to read (not Linux): torch's kernels are left alone
    assert cpu_flags("") == set() and native_bf16(set(), "x86_64")


def test_modes_resolve():
    bf16 = torch.bfloat16
    assert use_fp32_gemms("fp32", "cpu", bf16)
    assert not use_fp32_gemms("native", "cpu", bf16)
    assert use_fp32_gemms("auto", "cpu", bf16) == (not native_bf16())
    assert not use_fp32_gemms("fp32", "cpu", torch.float32)  # only bf16 weights
    assert not use_fp32_gemms("fp32", "cuda", bf16)  # CUDA is never touched
    with pytest.raises(ValueError, match="cpu_bf16_matmul"):
        use_fp32_gemms("fast", "cpu", bf16)
    with pytest.raises(MistillInputError, match="cpu_bf16_matmul"):
        RecipeConfig(cpu_bf16_matmul="fast").validate()


def _within_one_rounding(out: torch.Tensor, exact: torch.Tensor, scale: torch.Tensor) -> bool:
    """|out - exact| <= one bf16 ulp of |exact| (2^-7 relative, an upper bound), plus the fp32
    accumulation's own error bound where the sum cancels."""
    err = (out.double() - exact).abs()
    return bool((err <= exact.abs() * 2.0 ** -7 + 1e-5 * scale).all())


def test_linear_is_a_bf16_gemm():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 96, generator=g).bfloat16()
    layer = nn.Linear(96, 48, bias=True).bfloat16()
    with torch.no_grad():
        exact = x.double() @ layer.weight.double().T + layer.bias.double()
        scale = x.double().abs() @ layer.weight.double().abs().T + layer.bias.double().abs()
        native = layer(x)
        assert fp32_gemms(layer) == 1 and fp32_gemms(layer) == 0  # idempotent
        ours = layer(x)
    assert ours.dtype == torch.bfloat16
    assert _within_one_rounding(native, exact, scale)  # what torch's bf16 kernel gives
    assert _within_one_rounding(ours, exact, scale)
    # both round the same fp32-accumulated sums: they agree but for the odd rounding tie
    assert (ours == native).float().mean() > 0.99


def test_model_forward_backward_stays_bf16_and_close_to_native():
    ids = torch.randint(0, 3000, (1, 40), generator=torch.Generator().manual_seed(1))
    results = {}
    for name in ("native", "fp32"):
        lm = tiny_model("llama", layers=2, heads=4, kv_heads=2, d_head=16, d_model=64, seed=3, dtype="bfloat16")
        recipe = RecipeConfig(precision="bf16", cpu_bf16_matmul=name, gradient_checkpointing=True)
        model = prepare_student(lm.model, recipe)
        assert uses_fp32_gemms(model) == (name == "fp32")
        assert (model.config._attn_implementation == ATTENTION) == (name == "fp32")
        logits = model(ids).logits[0].float()
        nn.functional.cross_entropy(logits[:-1], ids[0, 1:]).backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert grads and all(g.dtype == torch.bfloat16 for g in grads.values())
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        results[name] = (logits, grads, model)
    (a, ga, _), (b, gb, model) = results["native"], results["fp32"]
    assert ga.keys() == gb.keys()
    # Error model. Both modes run the same bf16 network; they differ only where a bf16 rounding
    # is done on differently computed values: the GEMMs (fp32 sums accumulated in another order,
    # so an entry near a rounding boundary rounds the other way) and the attention (fp32 here,
    # torch's bf16 kernel there). Each such rounding moves an entry by at most u = 2^-8 of its
    # magnitude (8 significant bits). On the way to the logits there are about 19 of them: seven
    # projections and two in the attention per layer, two layers, and the LM head. Propagated
    # through normalised layers with random signs they add like a random walk, sqrt(19) u ~ 4.4 u
    # of the logit scale, plus the last rounding at full weight: bound 8 u = 2^-5 of the largest
    # logit. Measured on an AVX512-BF16 CPU over three inputs: 1.3 u (0.0052 of the largest logit).
    err = float((a - b).abs().max() / a.abs().max())
    assert err <= 2.0 ** -5, err
    # the backward pass adds two GEMMs per forward GEMM (about 57 roundings in all): sqrt(57) u
    # ~ 7.5 u, with a factor 2 for margin 16 u = 2^-4 of each gradient tensor's largest entry.
    # Measured: at most 3.5 u (0.0138 of the largest entry, a query projection)
    for n in ga:
        g_a, g_b = ga[n].float(), gb[n].float()
        diff, top = float((g_a - g_b).abs().max()), float(g_a.abs().max())
        assert top > 0 and diff <= 2.0 ** -4 * top, (n, diff, top)


def test_saved_checkpoint_keeps_standard_attention(tmp_path):
    lm = tiny_model("qwen3", layers=1, heads=2, kv_heads=1, d_head=8, d_model=16, seed=0, dtype="bfloat16")
    fp32_gemms(lm.model)
    lm.model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert ATTENTION not in json.dumps(saved)
