"""MuSiQue-Ans (Trivedi et al., 2022) multi-hop question answering as a task (paper App. O).

Each question comes with 20 titled passages; the model reasons, then writes a final answer
line. The paper's event is *answer emission*: a P2 event at every character of the emitted
answer at which it diverges from the alternative candidates of the question's inventory (the
character trie over the candidates), no P1 (there is no region-level decision), and the
contrastive event a diagnostic only.

Input: the public release's JSONL (``musique_ans_v1.0_{train,dev}.jsonl``), one question per
line with ``id``, ``question``, ``paragraphs`` (``idx``, ``title``, ``paragraph_text``,
``is_supporting``), ``answer``, ``answer_aliases`` and ``answerable``; read from a local path by
:func:`load_musique`, never downloaded.

Choices the paper does not fix **[recon]**:

* **Candidate inventory** of a question: its passage titles, the gold answer and its aliases
  (a title the reasoning names is already a title; named entities inside the passages are not
  candidates). Descriptions say where a candidate comes from.
* **Answer line**: after the last ``</think>`` (the whole text when it has no think tag), the
  last line of the form ``Answer: ...`` (case-insensitive, optional ``**`` bold marks); when
  there is none, the parser takes the last non-empty line, while the extractor gives no event
  (it needs the line's marker to know where the emission starts). The answer is stripped of
  surrounding whitespace, bold marks and quotes and of one final period.
* **Events**: the emitted answer, character by character, on the trie of the candidates
  (case-sensitive); the emitted answer need not be a candidate (the trie then stops branching
  once its prefix leaves every candidate). The first character is a P2 candidate like any
  other. Answers are written in words (:attr:`MuSiQueTask.word_items`): in a tokenizer, an
  event's competitors are the alternative candidates' own first tokens from the divergence on,
  as the paper's "every token of the emitted answer at which a candidate answer first
  diverges". An abstaining answer (empty, ``unanswerable``, ``unknown``, ``none``, ``n/a``, ``no
  answer``, ``cannot be determined``) has no event. :meth:`MuSiQueTask.related` is always false:
  no P2C events (the paper's contrastive event was a diagnostic, validated on 6 of 25).
* **Fields**: ``answer_aliases`` may be absent (no aliases) and ``answerable`` may be absent
  (true); the other fields are required.
* **Metric**: the official MuSiQue answer scores: exact match and token F1 after SQuAD
  normalisation (lower case, punctuation and the articles a / an / the removed, whitespace
  collapsed), the maximum over the answer and its aliases. An empty prediction scores 0
  (against a non-empty gold).

The stages read the release through :func:`load_musique_corpus` (``prepare -P task=musique``),
with these further choices **[recon]** (the paper gives neither the prompt nor the grouping
rule):

* **Prompt**: no candidate list (:data:`MUSIQUE_WORDING`); the note is the question's passages
  in the release's order, each as ``Passage <i>: <title>`` and its text, then ``Question:`` and
  the question. The instruction asks for a final ``Answer:`` line.
* **Candidates**: each question's :attr:`MuSiQueQuestion.candidates` are its note's
  ``shortlist``, the items its events are extracted over (the prompt does not list them); the
  inventory is the union of every question's candidates.
* **Groups**: the paper keeps "derivatives of one source question" together; a question's
  group (its note's ``patient_id``, the cluster of every note-clustered statistic) is
  :func:`question_group`, the first single-hop id of its composed id.
* **Splits**: questions of a file whose name holds ``train`` are train notes, every other file's
  (the labelled ``dev``) test notes. With ``split_sizes`` (App. O's locked design: 2,000
  training, 102 ranking and 1,203 selection questions from the train file, 1,610 evaluation
  questions from the dev file), :func:`split_by_groups` deals whole groups, in the order their
  first question appears in the file, to ``train``, ``val`` (the ranking questions) and
  ``select``, and the dev file's to ``test``; a group joins a split while the split stays within
  its size, and the questions left over are not part of the corpus.
"""

from __future__ import annotations

import collections
import json
import random
import re
import string
from collections.abc import Collection, Sequence
from typing import Any
from dataclasses import dataclass
from pathlib import Path

from mistill.data.corpus import Corpus, Note
from mistill.data.flips import Edit, apply_edits, sham_span, token_offsets, tokens_under, words
from mistill.data.inventory import Inventory
from mistill.data.prompts import PromptWording
from mistill.errors import MistillInputError
from mistill.evaluation.parsing import Answer, degenerate_reason
from mistill.tasks.base import (AnswerReader, Mention, Record, Span, Task, _merge, answer_part, jsonl_records,
                                read_traces, whole_word_mentions)

__all__ = ["MuSiQueTask", "MuSiQueQuestion", "Paragraph", "load_musique", "normalize_answer",
           "answer_em", "answer_f1", "ABSTAIN", "MUSIQUE_WORDING", "question_group", "question_text",
           "load_musique_corpus", "write_musique_fixture", "split_by_groups", "SPLIT_SIZES", "PAIR_SPLIT",
           "fixture_pair_proposals"]

ABSTAIN = frozenset({"", "unanswerable", "unknown", "none", "n/a", "no answer", "cannot be determined"})

_ANSWER_LINE = re.compile(r"^[ \t]*(?:\*\*)?answer(?:\*\*)?[ \t]*:(?:\*\*)?[ \t]*(.*?)[ \t]*$",
                          re.IGNORECASE | re.MULTILINE)


@dataclass(frozen=True)
class Paragraph:
    idx: int
    title: str
    text: str
    is_supporting: bool


@dataclass(frozen=True)
class MuSiQueQuestion:
    """One MuSiQue-Ans question as the release gives it."""

    id: str
    question: str
    paragraphs: tuple[Paragraph, ...]
    answer: str
    aliases: tuple[str, ...]
    answerable: bool

    @property
    def gold(self) -> tuple[str, ...]:
        """The answer and its aliases (the references of the metric)."""
        return (self.answer, *self.aliases)

    @property
    def candidates(self) -> dict[str, str]:
        """The candidate inventory: candidate -> where it comes from **[recon]**."""
        out: dict[str, str] = {}
        for p in self.paragraphs:
            if p.title.strip():
                out.setdefault(p.title.strip(), f"title of passage {p.idx}")
        for i, a in enumerate(self.gold):
            if a.strip():
                out.setdefault(a.strip(), "the answer" if i == 0 else "an answer alias")
        return out


def load_musique(path: str | Path) -> list[MuSiQueQuestion]:
    """Read a MuSiQue-Ans JSONL file. A malformed record raises :class:`MistillInputError`
    naming the file, the line, the question id and the field (``paragraphs[3].title``)."""
    out: list[MuSiQueQuestion] = []
    for rec, qid in jsonl_records(path, "id"):
        row, lineno = rec.row, rec.line
        raw = row.get("paragraphs")
        if not isinstance(raw, list) or not raw:
            raise rec.fail("missing field" if raw is None else "must be a non-empty list of passages",
                           "paragraphs")
        paragraphs = []
        for i, para in enumerate(raw):
            sub = Record(para, file=rec.file, line=lineno, record=qid, prefix=f"paragraphs[{i}].")
            paragraphs.append(Paragraph(idx=sub.integer("idx"), title=sub.text("title"),
                                        text=sub.text("paragraph_text"),
                                        is_supporting=sub.flag("is_supporting", default=False)))
        out.append(MuSiQueQuestion(id=qid, question=rec.text("question", allow_empty=False),
                                   paragraphs=tuple(paragraphs), answer=rec.text("answer"),
                                   aliases=rec.texts("answer_aliases", default=()),
                                   answerable=rec.flag("answerable", default=True)))
    if not out:
        raise MistillInputError("no questions in the file", file=str(path))
    return out


# ------------------------------------------------------------------------------ the answer

def _clean(answer: str) -> str:
    """Strip whitespace, bold marks, one final period (inside or outside quotes) and quotes."""
    a = answer.strip().strip("*").strip()
    if a.endswith(".") and not a.endswith(".."):
        a = a[:-1].rstrip()
    if len(a) >= 2 and a[0] == a[-1] and a[0] in "\"'":
        a = a[1:-1].strip()
        if a.endswith(".") and not a.endswith(".."):
            a = a[:-1].rstrip()
    return a


def _answer_span(text: str, start: int, end: int) -> Span | None:
    """Character span of the emitted answer on the final answer line of ``text[start:end]``."""
    last = None
    for m in _ANSWER_LINE.finditer(text, start, end):
        last = m
    if last is None:
        return None
    s, e = last.span(1)
    raw = text[s:e]
    cleaned = _clean(raw)
    if cleaned.casefold() in ABSTAIN:
        return None
    offset = raw.find(cleaned)
    return s + offset, s + offset + len(cleaned)


def normalize_answer(s: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def answer_em(pred: str, gold: str) -> float:
    return float(normalize_answer(pred) == normalize_answer(gold))


def answer_f1(pred: str, gold: str) -> float:
    """Token F1 after :func:`normalize_answer` (both empty: 1.0; one empty: 0.0)."""
    p, g = normalize_answer(pred).split(), normalize_answer(gold).split()
    if not p or not g:
        return float(p == g)
    common = collections.Counter(p) & collections.Counter(g)
    n = sum(common.values())
    if n == 0:
        return 0.0
    precision, recall = n / len(p), n / len(g)
    return 2 * precision * recall / (precision + recall)


class MuSiQueTask(Task):
    """MuSiQue-Ans answer emission. ``items`` is empty: each question's candidates are
    :attr:`MuSiQueQuestion.candidates`, passed to the extractor as its inventory."""

    name = "musique"
    has_p1 = False
    word_items = True  # an answer is written in words: the alternatives' own first tokens compete

    def find_mentions(self, text: str, items: Collection[str], start: int = 0,
                      end: int | None = None) -> list[Mention]:
        """The emitted answer of the final answer line after the last ``</think>`` in
        ``text[:end]`` (the whole range when the text has no think tag), as one naming: its item
        is the candidate it equals, else the emitted string itself."""
        end = len(text) if end is None else end
        close = text.rfind("</think>", 0, end)
        if close >= 0:
            start = max(start, close + len("</think>"))
        elif "<think>" in text[:end]:
            return []
        span = _answer_span(text, start, end)
        if span is None:
            return []
        return [(text[span[0]:span[1]], span[0], span[1])]

    def related(self, a: str, b: str) -> bool:
        """No contrastive relation: P2C is not used for this task **[recon]**."""
        return False

    @property
    def phases(self) -> tuple[str, ...]:
        """Answer emission only: P2 (the paper's loss phase for this task)."""
        return ("P2",)

    def item_like_spans(self, trace: str, items: Collection[str]) -> list[Span]:
        """Namings of candidates anywhere in the trace (whole words) and the emitted answer."""
        spans = [(s, e) for _, s, e in whole_word_mentions(trace, items)]
        spans += [(s, e) for _, s, e in self.find_mentions(trace, items)]
        return _merge(spans)

    def parse_answer(self, generation: str) -> tuple[str, ...]:
        """``(answer,)`` from the final answer line, else the last non-empty line; ``()`` for an
        invalid generation (reasoning not closed) or an abstention."""
        part = answer_part(generation)
        if part is None:
            return ()
        span = _answer_span(part, 0, len(part))
        if span is not None:
            return (part[span[0]:span[1]],)
        if _ANSWER_LINE.search(part):  # an abstaining answer line
            return ()
        lines = [ln for ln in part.splitlines() if ln.strip()]
        if not lines:
            return ()
        answer = _clean(lines[-1])
        return () if answer.casefold() in ABSTAIN else (answer,)

    set_valued = False

    def answer_reader(self, codes: Collection[str]) -> AnswerReader:
        """:meth:`read_answer` (the answer is free text: the inventory plays no part)."""
        return self.read_answer

    def read_answer(self, generation: str, capped: bool = False) -> Answer:
        """The stages' reading of a generation: invalid when capped or its reasoning is not closed;
        else ``parsed`` when its answer part holds text, the answer of :meth:`parse_answer` (none for
        an abstention, reason ``abstained``; reason ``no_answer`` when the answer part is empty)."""
        def answer(codes: tuple[str, ...], valid: bool, parsed: bool, reason: str) -> Answer:
            flag = degenerate_reason(codes, capped)
            return Answer(codes, valid, parsed, reason, len(codes), 0, 0, bool(flag), flag)

        if capped:
            return answer((), False, False, "capped")
        part = answer_part(generation)
        if part is None:
            return answer((), False, False, "unclosed_think")
        if not part.strip():
            return answer((), True, False, "no_answer")
        codes = self.parse_answer(generation)
        return answer(codes, True, True, "ok" if codes else "abstained")

    def metric(self, gold: Sequence[str], pred: Sequence[str]) -> dict[str, float]:
        """``em`` and ``f1``: the maximum over the references ``gold`` (answer + aliases) of the
        first predicted answer (an empty prediction is the empty string)."""
        refs = [g for g in gold if g is not None] or [""]
        p = pred[0] if pred else ""
        return {"em": max(answer_em(p, g) for g in refs), "f1": max(answer_f1(p, g) for g in refs)}


# ------------------------------------------------------------------------- through the stages

MUSIQUE_WORDING = PromptWording(
    header="", shows_list=False,
    summary_header="Here are the passages, then the question to answer:",
    role_and_task=("You are answering a multi-hop question. Answer the question above from the passages given "
                   "with it."),
    narrow_sentence=("Narrow down first to the passages that bear on the question, then decide the answer from "
                     "them."),
    answer="End with a final line of the form Answer: <answer>, the answer as a short phrase.")
"""The prompt's sentences for a question (**[recon]**: the paper gives the task, not its prompt)."""


def question_group(question_id: str) -> str:
    """The base-question group of a MuSiQue id (**[recon]**): the first single-hop id of the
    composed id (``2hop__482757_12019`` -> ``482757``); an id of another shape is its own group."""
    head, sep, rest = question_id.partition("__")
    return rest.split("_")[0] or question_id if sep else question_id


def question_text(q: MuSiQueQuestion) -> str:
    """The note text of a question: its passages, each ``Passage <i>: <title>`` and its text, then
    ``Question: <question>``."""
    blocks = [f"Passage {i}: {p.title.strip()}\n{p.text.strip()}" for i, p in enumerate(q.paragraphs, 1)]
    return "\n\n".join(blocks + [f"Question: {q.question.strip()}"])


def _release_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise MistillInputError("MuSiQue-Ans file or folder not found", file=str(path), field="corpus")
    files = sorted(p for p in path.glob("*.jsonl") if "train" in p.name or "dev" in p.name)
    if not files:
        raise MistillInputError("no MuSiQue-Ans train or dev JSONL file in the folder", file=str(path),
                                field="corpus")
    return files


SPLIT_SIZES: tuple[int, int, int, int] = (2_000, 102, 1_203, 1_610)
"""App. O's locked design: training, ranking and selection questions of the train file, and the
evaluation questions of the dev file (``prepare -P split_sizes=2000,102,1203,1610``); a fifth count
deals the evidence pairs' slice of the dev file, after the evaluation questions (split ``pairs``)."""

PAIR_SPLIT = "pairs"
"""The split of the dev file's slice the evidence pairs' bases come from (App. O)."""

_LAYOUT: tuple[tuple[str, ...], tuple[str, ...]] = (("train", "val", "select"), ("test", PAIR_SPLIT))


def split_by_groups(question_ids: Sequence[str], sizes: Sequence[int]) -> dict[str, str]:
    """``question id -> split`` for one file's questions: whole groups (:func:`question_group`),
    in the order of their first question, dealt to the splits in turn (``sizes[i]`` questions at
    most for the i-th; a group that does not fit closes the split, and the next split starts with
    it); questions left when every split is closed are left out."""
    order: list[str] = []
    members: dict[str, list[str]] = {}
    for qid in question_ids:
        g = question_group(qid)
        if g not in members:
            order.append(g)
            members[g] = []
        members[g].append(qid)
    out: dict[str, str] = {}
    i, filled = 0, 0
    for g in order:
        while i < len(sizes) and filled + len(members[g]) > sizes[i]:
            i, filled = i + 1, 0
        if i == len(sizes):
            break
        out.update({q: str(i) for q in members[g]})
        filled += len(members[g])
    return out


def load_musique_corpus(path: str | Path, *, traces_file: str | Path = "", order_seed: int = 0,
                        split_sizes: Sequence[int] = (), name: str = "musique",
                        privacy: str = "public") -> Corpus:
    """MuSiQue-Ans questions as a corpus: ``path`` is one of the release's JSONL files or a folder
    holding them (its ``*train*.jsonl`` and ``*dev*.jsonl`` files, in name order). One note per
    question (its id; :func:`question_group` as its group; train or test split from the file
    name), the :func:`question_text` as its text, the answer and its aliases as its gold, its
    candidates as its ``shortlist``, and its trace from ``traces_file`` (JSONL rows ``{"id",
    "trace"}``) when given. The inventory is every question's candidates (a
    ``random.Random(order_seed)`` shuffle of their sorted order). A question without an answer, an
    id in two files, a trace for an unknown question or a malformed record raises, naming the
    file, the question and the field. ``split_sizes`` (four counts: training, ranking, selection,
    evaluation questions; :data:`SPLIT_SIZES`; a fifth: the evidence pairs' slice) deals the
    questions by group instead (:func:`split_by_groups`): train-file questions to ``train``, ``val``
    and ``select``, dev-file questions to ``test`` and then :data:`PAIR_SPLIT`, the rest left out (a
    count of 0 leaves its split empty: ``2000,102,0,0`` holds the questions the teacher traces, with
    the same training and ranking questions as ``2000,102,1203,1610``)."""
    if split_sizes and (len(split_sizes) not in (4, 5) or min(split_sizes) < 0 or not sum(split_sizes)):
        raise MistillInputError(f"split_sizes must be four or five counts (train, val, select, test[, pairs]; 0 "
                                f"leaves a split empty, not all), not {tuple(split_sizes)!r}", field="split_sizes")
    questions: list[tuple[MuSiQueQuestion, str, Path]] = []
    seen: dict[str, Path] = {}
    for f in _release_files(Path(path)):
        train_file = "train" in f.name
        loaded = load_musique(f)
        if split_sizes:
            names = _LAYOUT[0] if train_file else _LAYOUT[1]
            dealt = split_by_groups([q.id for q in loaded], split_sizes[:3] if train_file else split_sizes[3:])
            splits = {q: names[int(i)] for q, i in dealt.items()}
        else:
            splits = {q.id: "train" if train_file else "test" for q in loaded}
        for q in loaded:
            if q.id in seen:
                raise MistillInputError(f"question also in {seen[q.id].name}", file=str(f), note=q.id, field="id")
            seen[q.id] = f
            if q.id not in splits:
                continue
            split = splits[q.id]
            if not q.answer.strip():
                raise MistillInputError("the question has no answer (MuSiQue-Ans questions have one)", file=str(f),
                                        note=q.id, field="answer")
            questions.append((q, split, f))
    # a question left out keeps none
    traces = read_traces(traces_file, "id", seen, "a question") if traces_file else {}
    items = sorted({c for q, _, _ in questions for c in q.candidates})
    random.Random(order_seed).shuffle(items)
    inventory = Inventory(codes=tuple(items), descriptions={c: "MuSiQue-Ans candidate" for c in items},
                          order_seed=order_seed, source="MuSiQue-Ans candidates (passage titles and answers)",
                          task="musique")
    notes = [Note(note_id=q.id, patient_id=question_group(q.id), split=split, text=question_text(q),
                  gold_codes=tuple(dict.fromkeys(a.strip() for a in q.gold if a.strip())),
                  teacher_trace=traces.get(q.id), shortlist=tuple(q.candidates),
                  meta={"source": "MuSiQue-Ans", "file": f.name, "answerable": q.answerable,
                        "supporting": [p.idx for p in q.paragraphs if p.is_supporting]})
             for q, split, f in questions]
    return Corpus(name=name, privacy=privacy, notes=notes, inventory=inventory, meta={"task": "musique"})


_FIXTURE_PEOPLE = ("Marta Lind", "Mark Lindqvist", "Maria Lopez", "Tomas Berg", "Tove Bergman", "Anna Holm")
_FIXTURE_FIRMS = ("Nordvik Works", "Nordlys Instruments", "Halden Mills", "Haldor Optics")
_FIXTURE_THINGS = ("the Vega lamp", "the Orion kettle", "the Lyra radio", "the Pavo clock", "the Draco fan",
                   "the Cetus scale")


def write_musique_fixture(folder: str | Path, *, questions_per_split: dict[str, int] | None = None,
                          seed: int = 0) -> dict[str, Path]:
    """A small release of the project's own in MuSiQue-Ans's layout under ``folder``: invented
    two-hop questions (which person founded the firm that makes a product) with four titled
    passages each, in ``musique_ans_v1.0_{train,dev}.jsonl``, and a scripted teacher trace per
    question in ``traces.jsonl`` (the two hops, a near-miss founder named, and an ``Answer:``
    line). Returns the paths by role (``corpus``, the folder; ``traces_file``)."""
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    counts = dict(questions_per_split or {"train": 6, "dev": 3})
    rng = random.Random(seed)
    traces = []
    n = 0
    for split, k in counts.items():
        rows = []
        for _ in range(k):
            n += 1
            thing = _FIXTURE_THINGS[n % len(_FIXTURE_THINGS)]
            firm, other = rng.sample(_FIXTURE_FIRMS, 2)
            founder, rival = rng.sample(_FIXTURE_PEOPLE, 2)
            qid = f"2hop__{7000 + (n + 1) // 2}_{8000 + n}"  # two questions of one base question
            paragraphs = [
                {"idx": 0, "title": thing.removeprefix("the ").title(), "is_supporting": True,
                 "paragraph_text": f"{thing[0].upper() + thing[1:]} is a household product made by {firm} since 1961."},
                {"idx": 1, "title": firm, "is_supporting": True,
                 "paragraph_text": f"{firm} is a manufacturer founded by {founder} in a small coastal town."},
                {"idx": 2, "title": other, "is_supporting": False,
                 "paragraph_text": f"{other} is a rival firm founded by {rival}."},
                {"idx": 3, "title": rival, "is_supporting": False,
                 "paragraph_text": f"{rival} is an engineer who later ran {other}."}]
            rng.shuffle(paragraphs)
            rows.append({"id": qid, "question": f"Who founded the company that makes {thing}?",
                         "paragraphs": paragraphs, "answer": founder,
                         "answer_aliases": [founder.split()[-1]], "answerable": True})
            trace = ("<think>The question has two hops: first the maker of the product, then the founder of "
                     f"that maker. One passage says {thing} is made by {firm}. Another passage says {firm} was "
                     f"founded by {founder}. The passage on {other} names {rival}, but that firm does not make "
                     f"{thing}, so {rival} is not the answer.</think>\nAnswer: {founder}")
            traces.append({"id": qid, "trace": trace})
        (root / f"musique_ans_v1.0_{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows),
                                                              encoding="utf-8")
    paths = {"corpus": root, "traces_file": root / "traces.jsonl"}
    paths["traces_file"].write_text("".join(json.dumps(t) + "\n" for t in traces), encoding="utf-8")
    return paths


def fixture_pair_proposals(notes: Sequence[Note], tokenizer: Any, *, first_case: int = 1) -> list[dict[str, Any]]:
    """App. O's evidence pairs for questions of :func:`write_musique_fixture` (proposals-file
    records, :func:`mistill.data.flips.read_proposals` with ``conditions``
    :data:`~mistill.data.flips.PAIR_CONDITIONS`; case ids ``mq-001``, ...): the flip writes the rival
    firm over the maker named in the product's passage, so that the rival's passage, already
    present, supports its founder (``B``) instead of the answer (``A``); the irrelevant edit
    rewrites the product's kind with as many words, the control paraphrases the year's phrase; the
    target masks are the maker's name in the original and the rival's in the flip, the shams
    token-matched runs elsewhere. For tests and smoke settings; a note without the fixture's
    sentences gets no proposal."""
    out: list[dict[str, Any]] = []
    for note in notes:
        text = note.text
        made = text.find(" made by ")
        rival_at = text.find(" is a rival firm founded by ")
        if made < 0 or rival_at < 0 or not note.gold_codes:
            continue
        start = made + len(" made by ")
        end = text.find(" since ", start)
        other = text[text.rfind("\n", 0, rival_at) + 1:rival_at]
        b_start = rival_at + len(" is a rival firm founded by ")
        partner = text[b_start:text.find(".", b_start)]
        kind = text.rfind("household", 0, made)
        year = text.find("since 1961", end)
        if end < 0 or kind < 0 or year < 0:
            continue
        flip = Edit(start, end, other)
        filler = " ".join((["everyday", "kitchen", "garden", "office"] * 4)[:len(words(other))])
        flipped, _, written = apply_edits(text, [flip])
        masks: dict[str, dict[str, list[list[int]]]] = {}
        for cond, body, target in (("original", text, [(start, end)]), ("flipped", flipped, written)):
            offsets = token_offsets(tokenizer, body)
            sham = sham_span(offsets, tokens_under(offsets, target), target)
            if sham is None:
                break
            masks[cond] = {"target_mask": [list(s) for s in target], "sham_mask": [list(s) for s in sham]}
        if len(masks) != 2:
            continue
        out.append({"case_id": f"mq-{first_case + len(out):03d}", "note_id": note.note_id,
                    "target_code": note.gold_codes[0], "partner_code": partner, "exceptions": [],
                    "versions": {"original": {"edits": [], **masks["original"]},
                                 "flipped": {"edits": [{"start": start, "end": end, "text": other}],
                                             **masks["flipped"]},
                                 "irrelevant": {"edits": [{"start": kind, "end": kind + len("household"),
                                                           "text": filler}]},
                                 "control": {"edits": [{"start": year, "end": year + len("since 1961"),
                                                        "text": "from 1961 on"}]}}})
    return out
