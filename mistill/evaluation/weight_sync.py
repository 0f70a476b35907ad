"""Pushing a model's current weights into a running vLLM engine (the generation probe's engine).

vLLM builds an engine from a model directory once; a model being trained changes its weights
after every optimizer step. Instead of building a new engine for each probe, the trainer writes
the student's parameters as safetensors shards (:func:`write_weights`) and every engine worker
loads them into the model it serves (:class:`WeightSync`, mixed into vLLM's worker through the
engine argument ``worker_extension_cls`` = :data:`WORKER_EXTENSION`, reached with
``LLM.collective_rpc``). The load is the model's own ``load_weights``, the path vLLM's loader
and TRL's colocated engine use: checkpoint names (``model.layers.0.self_attn.q_proj.weight``)
are mapped onto vLLM's fused layers, and each tensor is cast to the engine's dtype. Where the
model runner reloads in place from an iterator (``reload_weights(weights_iterator=...)``, vLLM
0.32), that is the call: it also redoes what the loader did to the weights after loading (vLLM's
CPU build repacks its linear layers' weights, which a bare ``load_weights`` cannot write to);
older releases get ``load_weights`` itself, which is what their CUDA layers need.

**[recon]** The weights pass through files, not memory: the engine runs in its own processes
(vLLM's default; it keeps the trainer's process free of vLLM's threads and its
``torch.distributed`` group), where TRL's colocated engine, inside the trainer's process, hands
it the tensors directly. This module imports neither vLLM nor transformers.
"""

from __future__ import annotations

import inspect
import shutil
from pathlib import Path

WORKER_EXTENSION = "mistill.evaluation.weight_sync.WeightSync"
"""vLLM's ``worker_extension_cls`` that adds :meth:`WeightSync.mistill_load_weights` to its workers."""
SHARD_BYTES = 1 << 30
"""Bytes per safetensors shard :func:`write_weights` writes (the last one may be smaller)."""
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
"""Name parts that activation checkpointing, ``torch.compile`` and FSDP wrappers add to a
parameter's name, removed so that the names are the checkpoint's."""


def checkpoint_name(name: str) -> str:
    """A parameter's name as the model's checkpoint writes it (wrapper prefixes removed)."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def write_weights(model, directory: Path, *, shard_bytes: int = SHARD_BYTES) -> list[str]:
    """Write ``model``'s parameters (tied ones once, as ``named_parameters`` gives them) to
    ``directory`` as safetensors shards of at most ``shard_bytes`` (a larger tensor gets a shard
    of its own), in the parameters' dtype; returns the shards' paths. Whatever the directory
    held is removed first."""
    import torch  # deferred: torch is slow to import
    from safetensors.torch import save_file  # deferred: safetensors only with torch

    directory = Path(directory)
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    paths: list[str] = []
    shard: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        nonlocal shard, size
        if shard:
            path = directory / f"weights-{len(paths):05d}.safetensors"
            save_file(shard, str(path))
            paths.append(str(path))
        shard, size = {}, 0

    with torch.no_grad():
        for name, param in model.named_parameters():
            tensor = param.detach().to("cpu").contiguous()
            if shard and size + tensor.nbytes > shard_bytes:
                flush()
            shard[checkpoint_name(name)] = tensor
            size += tensor.nbytes
    flush()
    return paths


class WeightSync:
    """Mixed into each vLLM worker (``worker_extension_cls``; the worker is ``self``)."""

    def mistill_load_weights(self, paths: list[str]) -> int:
        """Load the safetensors shards at ``paths`` into the model this worker serves, through
        the model's ``load_weights``; returns the number of tensors read."""
        import torch  # deferred: torch is slow to import
        from safetensors import safe_open  # deferred: safetensors only with torch

        runner = self.model_runner
        reload = getattr(runner, "reload_weights", None)
        in_place = reload is not None and "weights_iterator" in inspect.signature(reload).parameters
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        read = []

        def tensors():
            for path in paths:
                with safe_open(path, framework="pt", device="cpu") as f:
                    for name in f.keys():
                        read.append(name)
                        yield name, f.get_tensor(name)

        with torch.no_grad():
            if in_place:  # re-processes what the loader changed after loading (the CPU build repacks)
                reload(weights_iterator=tensors(), is_checkpoint_format=True)
            else:  # an older vLLM: the model's loader, as TRL's colocated engine loads
                model.load_weights(tensors())
        return len(read)


__all__ = ["WORKER_EXTENSION", "SHARD_BYTES", "checkpoint_name", "write_weights", "WeightSync"]
