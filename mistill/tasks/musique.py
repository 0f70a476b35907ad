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
  other. An abstaining answer (empty, ``unanswerable``, ``unknown``, ``none``, ``n/a``, ``no
  answer``, ``cannot be determined``) has no event. :meth:`MuSiQueTask.related` is always false:
  no P2C events (the paper's contrastive event was a diagnostic, validated on 6 of 25).
* **Fields**: ``answer_aliases`` may be absent (no aliases) and ``answerable`` may be absent
  (true); the other fields are required.
* **Metric**: the official MuSiQue answer scores: exact match and token F1 after SQuAD
  normalisation (lower case, punctuation and the articles a / an / the removed, whitespace
  collapsed), the maximum over the answer and its aliases. An empty prediction scores 0
  (against a non-empty gold).
"""

from __future__ import annotations

import collections
import re
import string
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

from mistill.errors import MistillInputError
from mistill.tasks.base import Mention, Record, Span, Task, _merge, answer_part, jsonl_records, whole_word_mentions

__all__ = ["MuSiQueTask", "MuSiQueQuestion", "Paragraph", "load_musique", "normalize_answer",
           "answer_em", "answer_f1", "ABSTAIN"]

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

    def metric(self, gold: Sequence[str], pred: Sequence[str]) -> dict[str, float]:
        """``em`` and ``f1``: the maximum over the references ``gold`` (answer + aliases) of the
        first predicted answer (an empty prediction is the empty string)."""
        refs = [g for g in gold if g is not None] or [""]
        p = pred[0] if pred else ""
        return {"em": max(answer_em(p, g) for g in refs), "f1": max(answer_f1(p, g) for g in refs)}
