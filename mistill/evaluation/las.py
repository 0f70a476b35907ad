"""Leakage-adjusted simulatability (LAS, App. K): a frozen simulator reads the note with and without a rationale.

A small causal LM is fine-tuned once (then frozen) to predict the teacher's final answer, the
JSON list of codes after ``</think>`` in the teacher's trace, from two inputs mixed at equal
weight: the note with the teacher's rationale (the text inside its reasoning block) and the note
alone. Per note,

    LAS = F1(sim(note ⊕ r), a_T) − F1(sim(note), a_T)

with ``r`` the rationale being scored (the teacher's own, or a student's) and ``a_T`` the
teacher's answer. The note-only term does not depend on ``r``, so only the difference is read.

Conventions (all documented where they are defined; the paper states none of them, each is
**[recon]**):

- The two input formats are :func:`format_with_rationale` and :func:`format_note_only`; the
  answer is never part of either, it is the target :func:`answer_target` that follows them.
- The note is the text the caller passes (``Note.text`` as stored), cut to its first
  ``max_note_words`` whitespace-separated words when that cap is positive, in training and in
  prediction alike (the cap is stored with the checkpoint). The paper's simulator reads the
  whole note (cap 0, ``LasSimulatorConfig.max_note_words``'s default); a cap is a cost control.
- The training target is the teacher's answer as a JSON list, shortened to the longest prefix of
  codes whose encoding fits ``max_answer_tokens`` (with the end-of-sequence token), so the
  simulator learns to close its list within the decoding cap.
- A prediction is greedy decoding of at most ``max_answer_tokens`` tokens, stopped at the
  end-of-sequence token or once a closed JSON list has been written, parsed with
  :func:`mistill.evaluation.parsing.parse_answer` (the project's rules; a generation without
  think tags is all answer) and restricted to the inventory. An unparsable prediction is an
  empty list and is counted (:attr:`Simulator.n_unparsable`), never an error.
- F1 of two sets is ``2|P ∩ G| / (|P| + |G|)``; **F1 of two empty sets is 1.0** (the simulator
  agrees exactly with a teacher that answered nothing), and 0.0 when only one is empty.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from mistill.data.inventory import Inventory
from mistill.errors import MistillInputError
from mistill.evaluation.parsing import CodeIndex, last_json_list, parse_answer, split_reasoning
from mistill.io import read_json, write_json
from mistill.models.decoding import cached_step
from mistill.models.loading import _offline, load_tokenizer, torch_dtype
from mistill.progress import track

META_FILE = "simulator.json"
"""The simulator's own settings beside the weights (base model, caps, format version)."""
INVENTORY_FILE = "inventory.json"
"""The inventory the predictions are restricted to (local only: never logged by the stage)."""
FORMAT_VERSION = 1
IGNORE_INDEX = -100
LAS_BATCH = 16
"""Prompts the simulator answers per ``generate`` call (:func:`greedy_answers`); an engineering
setting: a prompt's answer does not depend on it."""

NOTE_HEADER = "Discharge summary:\n"
RATIONALE_HEADER = "\n\nReasoning:\n"
ANSWER_CUE = "\n\nICD-10-CM codes (JSON list):\n"


# ------------------------------------------------------------------------------ arithmetic
def set_f1(predicted: Collection[str], gold: Collection[str]) -> float:
    """Per-note F1 between two code sets: ``2|P ∩ G| / (|P| + |G|)``.

    Convention: two empty sets give 1.0 (exact agreement on "no code"); one empty set and one
    non-empty set give 0.0.
    """
    p, g = set(predicted), set(gold)
    if not p and not g:
        return 1.0
    return 2.0 * len(p & g) / (len(p) + len(g))


def las_per_note(pred_with_rationale: set[str], pred_note_only: set[str],
                 teacher_answer: set[str]) -> float:
    """LAS of one note: ``F1(sim(note ⊕ r), a_T) − F1(sim(note), a_T)`` (see :func:`set_f1`)."""
    return set_f1(pred_with_rationale, teacher_answer) - set_f1(pred_note_only, teacher_answer)


# --------------------------------------------------------------------------- input formats
def truncate_words(text: str, max_words: int) -> str:
    """The first ``max_words`` whitespace-separated words of ``text`` joined by single spaces
    (``max_words <= 0``: the text, stripped, unchanged)."""
    if max_words <= 0:
        return text.strip()
    words = text.split()
    return text.strip() if len(words) <= max_words else " ".join(words[:max_words])


def format_with_rationale(note_text: str, rationale: str, *, max_note_words: int = 0) -> str:
    """Input (a): the note, then the rationale, then the answer cue.

    ::

        Discharge summary:
        <note, cut to max_note_words words>

        Reasoning:
        <rationale, stripped>

        ICD-10-CM codes (JSON list):

    The rationale is the text inside a reasoning block (no ``<think>`` tags, no answer). An
    empty rationale keeps the (empty) reasoning section: it is still input (a).
    """
    note = truncate_words(note_text, max_note_words)
    return f"{NOTE_HEADER}{note}{RATIONALE_HEADER}{rationale.strip()}{ANSWER_CUE}"


def format_note_only(note_text: str, *, max_note_words: int = 0) -> str:
    """Input (b): the note and the answer cue, no reasoning section.

    ::

        Discharge summary:
        <note, cut to max_note_words words>

        ICD-10-CM codes (JSON list):
    """
    note = truncate_words(note_text, max_note_words)
    return f"{NOTE_HEADER}{note}{ANSWER_CUE}"


def format_input(note_text: str, rationale: str | None, *, max_note_words: int = 0) -> str:
    """:func:`format_with_rationale` when ``rationale`` is a string, else :func:`format_note_only`."""
    if rationale is None:
        return format_note_only(note_text, max_note_words=max_note_words)
    return format_with_rationale(note_text, rationale, max_note_words=max_note_words)


def answer_target(codes: Sequence[str]) -> str:
    """The answer as the simulator writes it: a JSON list of code strings."""
    return json.dumps(list(codes))


def fitted_answer(codes: Sequence[str], tokenizer, max_answer_tokens: int) -> tuple[list[int], int]:
    """Token ids of the training target (the longest prefix of ``codes`` whose JSON list plus
    the end-of-sequence token fits ``max_answer_tokens``) and the number of codes kept."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    n = len(codes)
    while True:
        ids = tokenizer(answer_target(codes[:n]), add_special_tokens=False)["input_ids"] + eos
        if len(ids) <= max_answer_tokens or n == 0:
            return ids[:max_answer_tokens], n
        n -= 1


@dataclass(frozen=True)
class TeacherExample:
    """One training note: its text, the teacher's rationale and the teacher's answer codes."""

    note_id: str
    note_text: str
    rationale: str
    answer: tuple[str, ...]


def teacher_example(note_id: str, note_text: str, trace: str, index: CodeIndex) -> TeacherExample:
    """Split a teacher trace into rationale and answer (the project's parsing rules; an invalid
    trace has an empty answer)."""
    if not trace:
        raise MistillInputError("note has no teacher trace", note=note_id, field="teacher_trace")
    rationale, _ = split_reasoning(trace)
    return TeacherExample(note_id, note_text, rationale, parse_answer(trace, index).codes)


@dataclass
class Encoded:
    """One tokenised training sequence: input ids and labels (-100 outside the answer)."""

    input_ids: torch.Tensor
    labels: torch.Tensor


def encode(prompt: str, answer_ids: list[int], tokenizer, *, max_positions: int | None) -> Encoded:
    """Tokenise ``prompt`` and append ``answer_ids``; only the answer carries labels.

    A prompt longer than ``max_positions`` minus the answer keeps its last tokens (the end of
    the rationale and the answer cue).
    """
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if max_positions is not None:
        room = max_positions - len(answer_ids)
        if room <= 0:
            raise MistillInputError(f"max_answer_tokens leaves no room in {max_positions} positions",
                                    field="max_answer_tokens")
        ids = ids[-room:]
    full = torch.tensor(ids + answer_ids, dtype=torch.long)
    labels = full.clone()
    labels[: len(ids)] = IGNORE_INDEX
    return Encoded(full, labels)


def encode_pair(ex: TeacherExample, tokenizer, *, max_answer_tokens: int, max_note_words: int,
                max_positions: int | None) -> tuple[Encoded, Encoded]:
    """The note's two training sequences, (a) note + rationale and (b) note alone, one target."""
    answer_ids, _ = fitted_answer(ex.answer, tokenizer, max_answer_tokens)
    a = encode(format_with_rationale(ex.note_text, ex.rationale, max_note_words=max_note_words),
               answer_ids, tokenizer, max_positions=max_positions)
    b = encode(format_note_only(ex.note_text, max_note_words=max_note_words), answer_ids, tokenizer,
               max_positions=max_positions)
    return a, b


# --------------------------------------------------------------------------------- training
def answer_loss(model: torch.nn.Module, enc: Encoded) -> torch.Tensor:
    """Mean cross-entropy over the answer tokens of one sequence (next-token prediction)."""
    device = next(model.parameters()).device
    ids = enc.input_ids.to(device)[None]
    logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
    target = enc.labels.to(device)[1:]
    return torch.nn.functional.cross_entropy(logits, target, ignore_index=IGNORE_INDEX)


def _step_order(n: int, max_steps: int, seed: int) -> Iterator[int]:
    """Note indices for ``max_steps`` steps: seeded shuffled passes over the notes."""
    rng = random.Random(seed)
    order: list[int] = []
    for _ in range(max_steps):
        if not order:
            order = list(range(n))
            rng.shuffle(order)
        yield order.pop()


def train_simulator(model: torch.nn.Module, pairs: Sequence[tuple[Encoded, Encoded]], *,
                    max_steps: int, lr: float, seed: int, weight_decay: float = 0.0,
                    progress: bool = True) -> list[float]:
    """Fine-tune ``model`` in place; return the loss of every step.

    Each step takes one note (seeded shuffled passes) and averages the answer cross-entropy of
    its two inputs, so (a) and (b) have equal weight. Plain AdamW, one note per step, seeded
    (``torch.manual_seed(seed)``), so two calls with one seed on CPU give identical weights.
    The model is left in eval mode with gradients off (frozen).
    """
    if not pairs:
        raise MistillInputError("no training notes with a teacher trace", field="split")
    torch.manual_seed(seed)
    model.train()
    model.requires_grad_(True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                            weight_decay=weight_decay, foreach=False)
    losses: list[float] = []
    steps = _step_order(len(pairs), max_steps, seed)
    for i in track(steps, total=max_steps, desc="las simulator", disable=not progress):
        a, b = pairs[i]
        loss = 0.5 * (answer_loss(model, a) + answer_loss(model, b))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    model.requires_grad_(False)
    return losses


# ------------------------------------------------------------------------------- simulator
@torch.no_grad()
def greedy_answer(model: torch.nn.Module, tokenizer, prompt: str, *, max_new_tokens: int,
                  max_positions: int | None = None) -> str:
    """Greedy continuation of ``prompt`` (at most ``max_new_tokens`` tokens), stopped at the
    end-of-sequence token or as soon as the text holds a closed JSON list."""
    device = next(model.parameters()).device
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if max_positions is not None:
        ids = ids[-(max_positions - max_new_tokens):]
    eos = tokenizer.eos_token_id
    out: list[int] = []
    past = None
    step_ids = torch.tensor([ids], dtype=torch.long, device=device)
    for _ in range(max_new_tokens):
        logits, past = cached_step(model, step_ids, past)
        nxt = int(logits[0, -1].argmax())
        if eos is not None and nxt == eos:
            break
        out.append(nxt)
        if closes_list(tokenizer, out):
            break
        step_ids = torch.tensor([[nxt]], dtype=torch.long, device=device)
    return tokenizer.decode(out, skip_special_tokens=True)


def closes_list(tokenizer, new_ids: Sequence[int]) -> bool:
    """Whether the greedy answer ``new_ids`` is complete: its last token's text holds ``]`` and
    the text so far holds a closed JSON list (the stop rule of every simulator decode)."""
    return bool(new_ids) and "]" in tokenizer.decode(list(new_ids[-1:])) \
        and last_json_list(tokenizer.decode(list(new_ids))) is not None


def _stopped_text(tokenizer, new_ids: Sequence[int]) -> str:
    """The text :func:`greedy_answer` keeps of the greedy tokens ``new_ids``: up to (without) the
    end-of-sequence token, or up to (with) the token that closes the first JSON list."""
    eos = tokenizer.eos_token_id
    out: list[int] = []
    for token in new_ids:
        if eos is not None and token == eos:
            break
        out.append(int(token))
        if closes_list(tokenizer, out):
            break
    return tokenizer.decode(out, skip_special_tokens=True)


class _ClosedList(StoppingCriteria):
    """Marks a row of a batched greedy decode done once its new tokens hold a closed JSON list
    (checked, as :func:`greedy_answer` does, only after a token whose text holds ``]``)."""

    def __init__(self, tokenizer, prompt_width: int) -> None:
        self.tokenizer = tokenizer
        self.prompt_width = prompt_width

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        if input_ids.shape[1] <= self.prompt_width:
            return done
        for r, row in enumerate(input_ids[:, self.prompt_width:].tolist()):
            done[r] = closes_list(self.tokenizer, row)
        return done


@torch.no_grad()
def greedy_answers(model: torch.nn.Module, tokenizer, prompts: Sequence[str], *, max_new_tokens: int,
                   max_positions: int | None = None, batch_size: int = LAS_BATCH,
                   desc: str | None = None) -> list[str]:
    """:func:`greedy_answer` of every prompt, decoded ``batch_size`` prompts at a time.

    The prompts are sorted longest first and left-padded to ``[B, L]`` with an attention mask,
    one HF ``generate`` call per batch (greedy, the tokenizer's end-of-sequence token as the only
    stop, a row done once it closes a JSON list), and each row's tokens are cut by the same rule
    as :func:`greedy_answer`, so a prompt's answer does not depend on its batch-mates (up to float
    summation order). Returns the answers in the order of ``prompts``. ``desc``: a progress
    bar over the prompts under that label (None: none).
    """
    if int(batch_size) < 1:
        raise ValueError(f"batch_size must be at least 1, not {batch_size}")
    device = next(model.parameters()).device
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    if max_positions is not None:
        ids = [x[-(max_positions - max_new_tokens):] for x in ids]
    if any(len(x) == 0 for x in ids):
        raise ValueError("a prompt to answer needs at least one token")
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos if eos is not None else 0)
    settings = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=int(max_new_tokens),
                                eos_token_id=eos, pad_token_id=pad)
    order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))  # longest first; ties keep their order
    out: list[str] = [""] * len(ids)
    bar = track(desc=desc, total=len(ids), disable=desc is None)
    for start in range(0, len(order), int(batch_size)):
        rows = order[start:start + int(batch_size)]
        width = len(ids[rows[0]])
        batch = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, i in enumerate(rows):
            batch[r, width - len(ids[i]):] = torch.tensor(ids[i], dtype=torch.long)
            mask[r, width - len(ids[i]):] = 1
        seqs = model.generate(batch.to(device), attention_mask=mask.to(device), generation_config=settings,
                              stopping_criteria=StoppingCriteriaList([_ClosedList(tokenizer, width)]))
        for r, i in enumerate(rows):
            out[i] = _stopped_text(tokenizer, seqs[r, width:].tolist())
        bar.update(len(rows))
    bar.close()
    return out


_NOTE_ONLY: dict[tuple[str, str], str] = {}
"""Greedy note-only generations of frozen simulators in this process: ``(checkpoint key, input
text) -> generated text``. ``sim(note)`` does not depend on the model being evaluated, so every
``evaluate`` run after the first (the pipeline evaluates four models on the same notes with one
simulator) reads it from here instead of decoding it again."""


class Simulator:
    """A frozen LAS simulator: a causal LM, its tokenizer, the inventory and its caps.

    ``predict`` returns inventory codes; :attr:`n_predictions` and :attr:`n_unparsable` count
    the predictions made and those that held no JSON list (scored as empty).
    checkpoint_key: what identifies a saved (frozen) simulator's weights; with it, its greedy
    note-only generations are kept for the process (:data:`_NOTE_ONLY`). None (a model still
    being trained) keeps nothing.
    """

    def __init__(self, model: torch.nn.Module, tokenizer, inventory_codes: Collection[str], *,
                 max_answer_tokens: int, max_note_words: int = 0, checkpoint_key: str | None = None,
                 batch_size: int = LAS_BATCH) -> None:
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.index = inventory_codes if isinstance(inventory_codes, CodeIndex) else CodeIndex(inventory_codes)
        self.max_answer_tokens = int(max_answer_tokens)
        self.max_note_words = int(max_note_words)
        self.max_positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        self.n_predictions = 0
        self.n_unparsable = 0
        self.checkpoint_key = checkpoint_key
        self.batch_size = int(batch_size)

    def generate(self, note_text: str, rationale: str | None) -> str:
        """The raw greedy text after the input built by :func:`format_input` (a note-only
        input of a saved simulator decoded once per process): one pair of :meth:`generate_many`."""
        return self.generate_many([(note_text, rationale)], desc=None)[0]

    def generate_many(self, items: Sequence[tuple[str, str | None]], desc: str | None = "LAS simulator"
                      ) -> list[str]:
        """:meth:`generate` of many ``(note_text, rationale)`` pairs, decoded together
        (:func:`greedy_answers`, :attr:`batch_size` at a time, a progress bar labelled ``desc``);
        in the order given."""
        prompts = [format_input(text, rationale, max_note_words=self.max_note_words) for text, rationale in items]
        keys = [(self.checkpoint_key, p) if r is None and self.checkpoint_key else None
                for p, (_, r) in zip(prompts, items)]
        todo = sorted({p for p, k in zip(prompts, keys) if k is None or k not in _NOTE_ONLY})
        texts = dict(zip(todo, greedy_answers(self.model, self.tokenizer, todo, max_new_tokens=self.max_answer_tokens,
                                              max_positions=self.max_positions, batch_size=self.batch_size,
                                              desc=desc if todo else None)))
        for p, k in zip(prompts, keys):
            if k is not None and k in _NOTE_ONLY:
                texts[p] = _NOTE_ONLY[k]
            elif k is not None:
                _NOTE_ONLY[k] = texts[p]
        return [texts[p] for p in prompts]

    def parse(self, text: str) -> list[str]:
        """Inventory codes of a simulator generation; no JSON list -> ``[]``, counted."""
        self.n_predictions += 1
        answer = parse_answer(text, self.index)
        if not answer.parsed:
            self.n_unparsable += 1
        return list(answer.codes)

    def predict(self, note_text: str, rationale: str | None) -> list[str]:
        """Codes the simulator predicts from the note with ``rationale`` (None: the note alone)."""
        return self.parse(self.generate(note_text, rationale))

    def las(self, note_text: str, rationale: str, teacher_codes: Collection[str]) -> float:
        """LAS of ``rationale`` on one note against the teacher's answer ``teacher_codes``."""
        with_r = set(self.predict(note_text, rationale))
        without = set(self.predict(note_text, None))
        return las_per_note(with_r, without, set(teacher_codes))

    def las_many(self, items: Sequence[tuple[str, str, Collection[str]]]) -> list[float]:
        """:meth:`las` of many ``(note_text, rationale, teacher_codes)`` triples, the predictions
        with and without the rationales decoded together (:meth:`generate_many`)."""
        texts = self.generate_many([(note, r) for note, r, _ in items] + [(note, None) for note, _, _ in items])
        n = len(items)
        return [las_per_note(set(self.parse(texts[k])), set(self.parse(texts[n + k])), set(teacher))
                for k, (_, _, teacher) in enumerate(items)]


# ------------------------------------------------------------------------------ checkpoint
def save_simulator(out: Path, model: torch.nn.Module, tokenizer, inventory_json: Path, meta: dict,
                   *, with_tokenizer: bool = True) -> Path:
    """Write the checkpoint: weights and config, ``simulator.json``, the inventory (and the
    tokenizer when ``with_tokenizer``). Written to a temporary sibling and renamed."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        if with_tokenizer:
            tokenizer.save_pretrained(tmp)
        shutil.copyfile(inventory_json, tmp / INVENTORY_FILE)
        write_json(tmp / META_FILE, {"format_version": FORMAT_VERSION, **meta})
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def simulator_from_dir(path: Path, device: str = "cpu", *,
                       resolve_run: Callable[[str], str] | None = None) -> Simulator:
    """Load a checkpoint written by :func:`save_simulator` (tokenizer from the directory, else
    from the base model spec recorded in ``simulator.json``; ``resolve_run`` as
    :func:`mistill.models.loading.load_model`'s)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # deferred: transformers is slow to import

    path = Path(path)
    meta = read_json(path / META_FILE)
    if meta.get("format_version") != FORMAT_VERSION:
        raise MistillInputError(f"simulator format {meta.get('format_version')!r}, expected {FORMAT_VERSION}",
                                file=str(path / META_FILE), field="format_version")
    if not (path / INVENTORY_FILE).exists():
        raise MistillInputError("simulator checkpoint without its inventory", file=str(path / INVENTORY_FILE))
    _offline()
    if (path / "tokenizer_config.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    else:
        tokenizer = load_tokenizer(meta["base_model"], resolve_run=resolve_run)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype(meta.get("dtype", "float32")))
    model.to(device)
    inventory = Inventory.from_json(path / INVENTORY_FILE)
    key = f"{path.resolve()}:{hashlib.sha256((path / META_FILE).read_bytes()).hexdigest()}"
    return Simulator(model, tokenizer, list(inventory.codes), max_answer_tokens=meta["max_answer_tokens"],
                     max_note_words=meta.get("max_note_words", 0), checkpoint_key=key)


def load_simulator(run_id_or_path: str | Path, device: str = "cpu", *,
                   locate_run: Callable[[str], Path] | None = None,
                   resolve_run: Callable[[str], str] | None = None) -> Simulator:
    """The simulator a ``las_simulator`` run saved: a checkpoint directory holding
    ``simulator.json``, or a run id that ``locate_run`` turns into one (the stage's
    :func:`mistill.stages.las.simulator_dir`: the run's local work dir, else its logged artifacts)."""
    p = Path(run_id_or_path)
    if (p / META_FILE).exists():
        return simulator_from_dir(p, device, resolve_run=resolve_run)
    if locate_run is None:
        raise MistillInputError(f"{str(run_id_or_path)!r} is not a simulator checkpoint directory; a las_simulator "
                                "run id is found by the stage (mistill.stages.las.load_simulator)", field="las_run")
    return simulator_from_dir(locate_run(str(run_id_or_path)), device, resolve_run=resolve_run)
