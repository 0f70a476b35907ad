"""The generation probe during training (App. L.2): a few fixed validation notes decoded every
few optimizer steps, scored like an evaluation, so that a student whose loss looks healthy while
its answers go wrong is caught while it trains.

The paper's GOLD run is the case it exists for: its training losses stayed healthy to the last
step while its answers listed three-character ICD-10-CM categories (``N18`` where a billable
``N18.9`` is required) and its longer traces were truncated; the probe was added to the trainer
afterwards. Per probe it logs, over its notes (``probe/*`` metrics of the train run):

- ``parse_rate``: share of generations with a parsed final answer (a JSON list after
  ``</think>``, not capped); ``cap_rate``: share that reached the probe's token cap;
  ``truncated_rate``: share not valid (capped, or the reasoning never closed);
  ``degenerate_rate``: the evaluation's degenerate guard;
- ``category_rate``: share of the answers' string entries that are not inventory codes but an
  inventory code's category (a strict prefix of one, compared undotted: ``N18`` of ``N18.9``);
- ``micro_f1``: the answers scored against the notes' gold codes (:func:`micro_prf`);
  ``mean_tokens``: generated tokens per note;
- ``flagged``: 1 when ``category_rate`` or ``truncated_rate`` reaches the flag share, else 0.

The train stage logs ``probe/seconds`` beside them: what the probe cost in wall time.

The generation is the evaluation's sampling with the probe's own token cap: the paper's
decoding, each note drawn with its own seed (:func:`~mistill.evaluation.generation.note_seed`),
so its tokens do not depend on the other probe notes or the batch. Either backend samples it
(the train stage's ``probe_backend``): HF's batched generation with the model being trained
(:func:`~mistill.evaluation.generation.generate_hf_many`: left-padded batches, a seeded generator
per note, the global RNG, training's draws, untouched), or a vLLM engine built once per run and
given the student's current weights before each probe
(:class:`~mistill.evaluation.backends.SyncedVLLMBackend`). The metrics are computed from the
generations alone, so the two backends' probes differ only as their samples do. No text leaves
the probe: only these numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mistill.evaluation.generation import DecodingConfig, Generation, generate_hf_many, note_seed
from mistill.evaluation.metrics import micro_prf
from mistill.evaluation.parsing import CodeIndex, last_json_list, parse_answer, split_reasoning, undotted

PROBE_METRICS = ("parse_rate", "cap_rate", "truncated_rate", "degenerate_rate", "category_rate", "micro_f1",
                 "mean_tokens", "flagged")
"""What each probe logs, as ``probe/<name>``."""


@dataclass(frozen=True)
class ProbeNote:
    """One probe note: its chat-templated prompt, gold codes and sampling seed (no trace)."""

    note_id: str
    prompt_text: str
    gold: tuple[str, ...]
    seed: int


def probe_notes(prepared, tokenizer, split: str, n: int, decoding: DecodingConfig) -> list[ProbeNote]:
    """The first ``n`` notes of ``split`` in corpus order (fixed for the whole run), each with
    the prompt the evaluation gives it (its shortlist, the prepared corpus's settings)."""
    notes = [note for note in prepared.corpus.notes if note.split == split][:n]
    return [ProbeNote(note.note_id, prepared.prompt(note, tokenizer).text,
                      tuple(note.gold_codes), note_seed(decoding, note.note_id))
            for note in notes]


def category_entries(text: str, index: CodeIndex, categories: frozenset[str]) -> tuple[int, int]:
    """``(category entries, string entries)`` of a generation's answer list: entries that are
    not inventory codes but an inventory code's category, and all string entries (0, 0 without
    a closed reasoning block or a list)."""
    _, answer = split_reasoning(text)
    entries = last_json_list(answer) or []
    strings = [e for e in entries if isinstance(e, str)]
    cats = sum(1 for e in strings if index.lookup(e) is None and undotted(e.strip()).upper() in categories)
    return cats, len(strings)


def inventory_categories(codes: Sequence[str]) -> frozenset[str]:
    """Every strict prefix of at least three characters of the inventory's undotted codes that
    is not itself an inventory code: the categories (and subcategories) a truncated code names."""
    full = {undotted(c).upper() for c in codes}
    return frozenset(code[:k] for code in full for k in range(3, len(code)) if code[:k] not in full)


def probe_metrics(generations: Sequence[Generation], gold: Sequence[Sequence[str]], index: CodeIndex,
                  categories: frozenset[str], flag_share: float) -> dict[str, float]:
    """The probe's metrics (:data:`PROBE_METRICS`) over one probe's generations."""
    n = len(generations)
    if n == 0:
        raise ValueError("a probe needs at least one generation")
    answers = [parse_answer(g.text, index, capped=g.capped) for g in generations]
    cats = [category_entries(g.text, index, categories) if a.valid else (0, 0) for g, a in zip(generations, answers)]
    n_strings = sum(s for _, s in cats)
    category_rate = sum(c for c, _ in cats) / n_strings if n_strings else 0.0
    truncated_rate = sum(not a.valid for a in answers) / n
    out = {"parse_rate": sum(a.parsed for a in answers) / n,
           "cap_rate": sum(g.capped for g in generations) / n,
           "truncated_rate": truncated_rate,
           "degenerate_rate": sum(a.degenerate for a in answers) / n,
           "category_rate": category_rate,
           "micro_f1": micro_prf(gold, [list(a.codes) for a in answers])[2],
           "mean_tokens": sum(g.n_tokens for g in generations) / n}
    out["flagged"] = float(category_rate >= flag_share or truncated_rate >= flag_share)
    return out


class GenerationProbe:
    """Decodes the probe notes with the model being trained and scores them (see the module
    docstring). ``__call__()`` returns the metrics; the model is left in the mode it had.
    ``backend``: what samples the notes (a :class:`~mistill.evaluation.backends.Backend` that
    follows ``lm``'s weights, such as :class:`~mistill.evaluation.backends.SyncedVLLMBackend`);
    None: HF generation with ``lm``."""

    def __init__(self, lm, notes: Sequence[ProbeNote], inventory_codes: Sequence[str], decoding: DecodingConfig,
                 flag_share: float, backend=None) -> None:
        if not notes:
            raise ValueError("a probe needs at least one note")
        self.lm = lm
        self.notes = list(notes)
        self.decoding = decoding
        self.index = CodeIndex(list(inventory_codes))
        self.categories = inventory_categories(list(inventory_codes))
        self.flag_share = flag_share
        self.backend = backend

    def generate(self, notes: Sequence[ProbeNote]) -> list[Generation]:
        """One completion per note, in the order given, each with its own seed: through the
        backend in one call, or decoded together in HF batches
        (:func:`~mistill.evaluation.generation.generate_hf_many`); the model's train/eval mode and
        the global RNG are left as they were."""
        items = [(n.prompt_text, n.seed) for n in notes]
        if self.backend is not None:
            return self.backend.generate_many(items) if items else []
        return generate_hf_many(self.lm, items, self.decoding)

    def score(self, generations: Sequence[Generation], notes: Sequence[ProbeNote]) -> dict[str, float]:
        return probe_metrics(generations, [n.gold for n in notes], self.index, self.categories, self.flag_share)

    def __call__(self) -> dict[str, float]:
        return self.score(self.generate(self.notes), self.notes)


__all__ = ["PROBE_METRICS", "ProbeNote", "probe_notes", "category_entries", "inventory_categories", "probe_metrics",
           "GenerationProbe"]
