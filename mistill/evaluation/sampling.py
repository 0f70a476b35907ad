"""Many notes through one backend, in calls the engine can batch, resumable note by note.

A stage that samples a completion per note and then reads the model again (``evaluate``'s
teacher-forced readouts, ``own_heads``' passes over the arm's own traces) first samples every
pending note with :func:`sample_notes`, then frees the engine, then does its per-note passes.
The backend sees ``chunk`` notes per :meth:`~mistill.evaluation.backends.Backend.generate_many`
call (vLLM schedules them together; the HF backend decodes them in left-padded batches). Each
finished sample is written at once, atomically, as ``<stage_dir>/<note_id>.json``: a crash loses
at most the call in flight, and a rerun samples only the notes that have no file yet. A staged
file is trusted only when its seed and decoding settings are those the note would get now;
any other is sampled again.

The stage directory is local to this machine and never uploaded (a restricted corpus's model
text stays there, as in the run's enclave).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path

from mistill.evaluation.backends import Backend, make_backend, resolve_backend
from mistill.evaluation.generation import DecodingConfig, Generation
from mistill.io import write_json
from mistill.models.loading import LoadedModel
from mistill.progress import track

DEFAULT_CHUNK = 256
"""Notes per engine call when a stage does not say: far more than the sequences of paper-length
prompts that fit one GPU's KV cache together, so the engine stays full, and few enough that a
crash loses little."""


def call_size(backend: Backend) -> int:
    """Notes per engine call for ``backend``: :data:`DEFAULT_CHUNK` for vLLM (its scheduler fills
    the KV cache from them), the batch of one ``generate`` call for HF (a call's notes are
    written when it returns, so a crash loses one batch)."""
    size = getattr(backend, "call_size", None)
    return int(size) if size else DEFAULT_CHUNK


@dataclasses.dataclass(frozen=True)
class SampleRequest:
    """One note to sample: its id, its chat-templated prompt and its sampling seed."""

    note_id: str
    prompt_text: str
    seed: int


def _staged(path: Path, request: SampleRequest, decoding: dict) -> Generation | None:
    """The staged sample at ``path`` if it is complete and was drawn as ``request`` would be now
    (its seed, and every setting of ``decoding``), else None."""
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        gen = Generation(**record)
    except (ValueError, TypeError):  # a foreign or damaged file: sampled again
        return None
    if gen.seed != request.seed or any(gen.decoding.get(k) != v for k, v in decoding.items()):
        return None
    return gen


def sample_notes(requests: Sequence[SampleRequest], stage_dir: Path, open_backend: Callable[[], Backend],
                 decoding: dict, *, chunk: int = 0, desc: str = "sample") -> dict[str, Generation]:
    """Every request's :class:`Generation`, keyed by note id: staged ones read back, the others
    sampled ``chunk`` at a time (0: :func:`call_size` of the backend) through the backend
    ``open_backend()`` builds (only when a note is left to sample) and closed once they are done.
    The requests left are sampled longest prompt first (ties in the order given): the first call
    then sizes the HF path's static cache for the whole run, so its compiled decode step is not
    compiled again for a longer prompt later. A sample does not depend on its batch-mates.

    decoding: the settings every sample records (:meth:`DecodingConfig.to_dict`), which a staged
    sample must match. A generation's ``decoding`` keeps the backend that drew it.
    """
    if chunk < 0:
        raise ValueError(f"chunk must be 0 (the backend's) or positive, got {chunk}")
    out: dict[str, Generation] = {}
    todo: list[SampleRequest] = []
    for request in requests:
        gen = _staged(stage_dir / f"{request.note_id}.json", request, decoding)
        if gen is None:
            todo.append(request)
        else:
            out[request.note_id] = gen
    if not todo:
        return out
    todo.sort(key=lambda r: -len(r.prompt_text))
    stage_dir.mkdir(parents=True, exist_ok=True)
    backend = open_backend()
    try:
        chunk = chunk or call_size(backend)
        bar = track(total=len(todo), desc=f"{desc} ({backend.name})")
        for start in range(0, len(todo), chunk):
            part = todo[start:start + chunk]
            gens = backend.generate_many([(r.prompt_text, r.seed) for r in part])
            for request, gen in zip(part, gens, strict=True):
                write_json(stage_dir / f"{request.note_id}.json", dataclasses.asdict(gen), indent=None)
                out[request.note_id] = gen
            bar.update(len(part))
        bar.close()
    finally:
        backend.close()
    return out


def sample_then_load(requests: Sequence[SampleRequest], stage_dir: Path, spec: str, decoding: DecodingConfig,
                     load: Callable[[], LoadedModel], *, backend: str, device: str, dtype: str,
                     desc: str = "sample", resolve_run: Callable[[str], str] | None = None,
                     ) -> tuple[dict[str, Generation], LoadedModel]:
    """:func:`sample_notes` of ``requests`` with the model ``spec``, then the model a stage's
    per-note passes read (``load()``): the HF backend samples with that model, loaded once;
    vLLM's engine (``backend`` resolves to ``vllm``) is freed before ``load()`` runs, so the two
    never hold the device together. ``resolve_run``: as :func:`mistill.models.loading.load_model`'s."""
    name = resolve_backend(backend, device)
    lm = load() if name == "hf" else None
    samples = sample_notes(requests, stage_dir, lambda: make_backend(name, spec, decoding, device=device,
                                                                     dtype=dtype, lm=lm, resolve_run=resolve_run),
                           decoding.to_dict(), desc=desc)
    return samples, (lm if lm is not None else load())


__all__ = ["DEFAULT_CHUNK", "call_size", "SampleRequest", "sample_notes", "sample_then_load"]
