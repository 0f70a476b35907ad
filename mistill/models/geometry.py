"""Head geometry: where each family keeps its attention parts, read from one declarative table.

One row per model family says where the decoder layers, the q/k/v/o projections, the per-head
q/k norms, the rotary embedding and the final norm live. :func:`head_geometry` reads the row
for a loaded model and returns a :class:`HeadGeometry`; the instrument and the trainer never
probe modules with ``hasattr`` chains.

Head names are ``L{layer}H{head}``; a head's flat index is ``layer * n_heads + head``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from mistill.errors import MistillInputError


@dataclass(frozen=True)
class FamilySpec:
    """Module paths of one decoder family (dotted attribute paths from the CausalLM root)."""

    layers: str = "model.layers"
    embed: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    lm_head: str = "lm_head"
    rotary: str = "model.rotary_emb"
    attn: str = "self_attn"
    q_proj: str = "q_proj"
    k_proj: str = "k_proj"
    v_proj: str = "v_proj"
    o_proj: str = "o_proj"
    q_norm: str | None = None
    k_norm: str | None = None
    input_norm: str = "input_layernorm"
    post_norm: str = "post_attention_layernorm"
    mlp: str = "mlp"
    # config attribute listing, per layer, whether rotary is applied (SmolLM3's NoPE layers)
    rope_flags: str | None = None


FAMILIES: dict[str, FamilySpec] = {
    "llama": FamilySpec(),
    "qwen2": FamilySpec(),  # q/k/v carry biases inside the Linear modules; nothing else differs
    "qwen3": FamilySpec(q_norm="q_norm", k_norm="k_norm"),
    "smollm3": FamilySpec(rope_flags="no_rope_layers"),
}


def _get(root: nn.Module, path: str) -> nn.Module:
    obj = root
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class LayerParts:
    """The attention and MLP parts of one decoder layer."""

    index: int
    layer: nn.Module
    attn: nn.Module
    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    o_proj: nn.Linear
    q_norm: nn.Module | None
    k_norm: nn.Module | None
    input_norm: nn.Module
    post_norm: nn.Module
    mlp: nn.Module
    use_rope: bool
    scaling: float


@dataclass(frozen=True)
class HeadGeometry:
    """Shape and parts of a decoder-only model's attention.

    Attributes:
        family: key of :data:`FAMILIES`.
        n_layers, n_heads, n_kv_heads, d_head, d_model, vocab: sizes.
        layers: one :class:`LayerParts` per layer.
        embed, final_norm, lm_head, rotary: model-level parts.
        apply_rope: the family's ``apply_rotary_pos_emb(q, k, cos, sin)``.
    """

    family: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_model: int
    vocab: int
    layers: tuple[LayerParts, ...] = field(repr=False)
    embed: nn.Module = field(repr=False)
    final_norm: nn.Module = field(repr=False)
    lm_head: nn.Module = field(repr=False)
    rotary: nn.Module = field(repr=False)
    apply_rope: Callable = field(repr=False)

    @property
    def n_groups(self) -> int:
        """Query heads per KV head (GQA group size)."""
        return self.n_heads // self.n_kv_heads

    @property
    def n_total_heads(self) -> int:
        return self.n_layers * self.n_heads

    def head_name(self, flat: int) -> str:
        return f"L{flat // self.n_heads}H{flat % self.n_heads}"

    def head_names(self) -> list[str]:
        return [self.head_name(i) for i in range(self.n_total_heads)]

    def head_index(self, name: str) -> int:
        """Flat index of ``L{layer}H{head}``."""
        try:
            layer, head = name[1:].split("H")
            layer_i, head_i = int(layer), int(head)
        except ValueError:
            raise MistillInputError(f"malformed head name {name!r}; expected L<layer>H<head>",
                                    field="head") from None
        if not (0 <= layer_i < self.n_layers and 0 <= head_i < self.n_heads):
            raise MistillInputError(f"head {name} outside {self.n_layers} layers x {self.n_heads} heads",
                                    field="head")
        return layer_i * self.n_heads + head_i

    def to_dict(self) -> dict:
        return {"family": self.family, "n_layers": self.n_layers, "n_heads": self.n_heads,
                "n_kv_heads": self.n_kv_heads, "d_head": self.d_head, "d_model": self.d_model,
                "vocab": self.vocab}


def family_of(model: nn.Module) -> str:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in FAMILIES:
        raise MistillInputError(
            f"model family {model_type!r} has no head-geometry row; supported: {sorted(FAMILIES)}",
            field="model")
    return model_type


def head_geometry(model: nn.Module) -> HeadGeometry:
    """Read the geometry row for ``model`` (a HF ``*ForCausalLM``)."""
    family = family_of(model)
    spec = FAMILIES[family]
    cfg = model.config
    n_heads = cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
    d_head = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    layer_types = getattr(cfg, "layer_types", None) or ()
    if getattr(cfg, "use_sliding_window", False) and "sliding_attention" in layer_types:
        raise MistillInputError("sliding-window attention layers are not supported by the instrument",
                                field="model")
    rope_flags = getattr(cfg, spec.rope_flags) if spec.rope_flags else None
    layers = []
    for i, layer in enumerate(_get(model, spec.layers)):
        attn = getattr(layer, spec.attn)
        layers.append(LayerParts(
            index=i, layer=layer, attn=attn,
            q_proj=getattr(attn, spec.q_proj), k_proj=getattr(attn, spec.k_proj),
            v_proj=getattr(attn, spec.v_proj), o_proj=getattr(attn, spec.o_proj),
            q_norm=getattr(attn, spec.q_norm) if spec.q_norm else None,
            k_norm=getattr(attn, spec.k_norm) if spec.k_norm else None,
            input_norm=getattr(layer, spec.input_norm), post_norm=getattr(layer, spec.post_norm),
            mlp=getattr(layer, spec.mlp),
            use_rope=bool(rope_flags[i]) if rope_flags is not None else True,
            scaling=float(getattr(attn, "scaling", d_head ** -0.5)),
        ))
    module = sys.modules[type(model).__module__]
    apply_rope = getattr(module, "apply_rotary_pos_emb")
    embed = _get(model, spec.embed)
    return HeadGeometry(
        family=family, n_layers=len(layers), n_heads=n_heads, n_kv_heads=n_kv, d_head=d_head,
        d_model=cfg.hidden_size, vocab=embed.weight.shape[0], layers=tuple(layers), embed=embed,
        final_norm=_get(model, spec.final_norm), lm_head=_get(model, spec.lm_head),
        rotary=_get(model, spec.rotary), apply_rope=apply_rope,
    )


def split_heads(z: torch.Tensor, n_heads: int) -> torch.Tensor:
    """View an o_proj input ``[..., head * d_head]`` as ``[..., head, d_head]``."""
    return z.view(*z.shape[:-1], n_heads, z.shape[-1] // n_heads)


def final_norm_scale(geometry: HeadGeometry, final_residual: torch.Tensor) -> torch.Tensor:
    """The final RMSNorm's per-position scale ``1 / rms(x) = rsqrt(mean(x^2) + eps)``.

    Args:
        final_residual: ``[row, d_model]``. Returns ``[row]`` float32.
    """
    norm = geometry.final_norm
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if eps is None or getattr(norm, "weight", None) is None or getattr(norm, "bias", None) is not None:
        raise MistillInputError(f"the final norm {type(norm).__name__} is not an RMSNorm with a weight",
                                field="model")
    x = final_residual.float()
    return torch.rsqrt(x.pow(2).mean(-1) + float(eps))
