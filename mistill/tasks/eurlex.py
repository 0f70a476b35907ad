"""EURLEX57K (Chalkidis et al., 2019): labelling EU legislative acts with EuroVoc concepts
(paper App. P).

The teacher labels an act from a shown candidate list of EuroVoc concepts. Events are the
exact candidate-concept namings in the reasoning: P2 at the characters of a first naming where
the candidates' character trie branches (no P1), P2C where a concept is named after a related
concept (a EuroVoc broader, narrower or sibling concept) at their first differing character.

Inputs, read from local paths (never downloaded):

* the release's documents, one JSON file per act (``dataset/{train,dev,test}/<celex>.json``)
  with ``celex_id``, ``title``, ``header``, ``recitals``, ``main_body`` (a list of strings),
  ``attachments`` and ``concepts`` (EuroVoc ids): :func:`load_eurlex_documents`, given one file
  or a folder (every ``*.json`` below it, in sorted path order);
* the release's concept file ``EURLEX57K.json``: an object mapping a EuroVoc id to an object
  with at least ``label`` (other keys are ignored): :func:`load_eurovoc`;
* the hierarchy: the release has none, so it is a small local JSON file defined here
  **[recon]**: an object mapping a concept id to the list of its broader concept ids
  (``{"1309": ["2000"]}``); ids must be concepts of the concept file: :func:`load_broader`.

Choices the paper does not fix **[recon]**:

* **Items** are the concepts' labels (what the reasoning writes); a label shared by two ids is
  an error. Gold answers and parsed answers are labels too.
* **Mention**: a candidate label as whole words (no letter, digit or underscore on either
  side), case-insensitive; overlapping namings resolve to the earliest, then the longest. A
  naming written in another case gets events only after its last character that differs from
  the label (the extractor's rule for written forms).
* **Relation**: ``b`` is a broader concept of ``a``, a narrower one, or a sibling (they share a
  broader concept); without a hierarchy file no two concepts are related (no P2C).
* **Answer**: a JSON list after ``</think>`` (the last list; an unclosed reasoning block gives
  no answer) whose entries are labels (case-insensitive) or EuroVoc ids (strings or integers);
  entries naming no concept are dropped, duplicates too.
* **Metric**: set counts, precision, recall and F1 per act; :func:`micro_f1` pools the counts
  over acts (the paper's micro-F1).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from mistill.errors import MistillInputError
from mistill.evaluation.metrics import prf_from_counts
from mistill.evaluation.parsing import last_json_list
from mistill.io import read_json
from mistill.tasks.base import Mention, Record, Task, answer_part, set_scores, whole_word_mentions

__all__ = ["EurlexTask", "EurlexAct", "load_eurlex_documents", "load_eurovoc", "load_broader", "micro_f1"]


@dataclass(frozen=True)
class EurlexAct:
    """One act of the release."""

    celex_id: str
    title: str
    header: str
    recitals: str
    main_body: tuple[str, ...]
    attachments: str
    concepts: tuple[str, ...]
    file: str = ""

    @property
    def text(self) -> str:
        """The act's text: title, header, recitals, main body, attachments, one per paragraph."""
        parts = [self.title, self.header, self.recitals, *self.main_body, self.attachments]
        return "\n\n".join(p.strip() for p in parts if p.strip())


def _read_json(path: Path):
    return read_json(path)


def load_eurlex_documents(path: str | Path) -> list[EurlexAct]:
    """The acts of one document file or of every ``*.json`` file below a folder. A malformed
    document raises :class:`MistillInputError` naming its file, its CELEX id and the field."""
    p = Path(path)
    if not p.exists():
        raise MistillInputError("file not found", file=str(p))
    files = sorted(p.rglob("*.json")) if p.is_dir() else [p]
    if not files:
        raise MistillInputError("no *.json document files in the folder", file=str(p))
    out = []
    seen: dict[str, str] = {}
    for f in files:
        row = _read_json(f)
        cid = row.get("celex_id") if isinstance(row, dict) else None
        rec = Record(row, file=str(f), record=str(cid) if isinstance(cid, (str, int)) else None)
        celex = rec.text("celex_id", allow_empty=False)
        if celex in seen:
            raise rec.fail(f"CELEX id also in {seen[celex]}", "celex_id")
        seen[celex] = str(f)
        concepts = rec.texts("concepts", ids=True)
        out.append(EurlexAct(celex_id=celex, title=rec.text("title", allow_empty=False),
                             header=rec.text("header", default=""), recitals=rec.text("recitals", default=""),
                             main_body=rec.texts("main_body"), attachments=rec.text("attachments", default=""),
                             concepts=concepts, file=str(f)))
    return out


def load_eurovoc(path: str | Path) -> dict[str, str]:
    """EuroVoc id -> label from the release's ``EURLEX57K.json``."""
    p = Path(path)
    data = _read_json(p)
    if not isinstance(data, dict) or not data:
        raise MistillInputError("the concept file must be a non-empty JSON object id -> concept", file=str(p))
    out: dict[str, str] = {}
    for cid, entry in data.items():
        rec = Record(entry, file=str(p), record=str(cid))
        out[str(cid)] = rec.text("label", allow_empty=False).strip()
    return out


def load_broader(path: str | Path, concepts: Mapping[str, str]) -> dict[str, tuple[str, ...]]:
    """Concept id -> its broader concept ids, from the local hierarchy file (see the module
    docstring); every id must be a concept of ``concepts``."""
    p = Path(path)
    data = _read_json(p)
    if not isinstance(data, dict):
        raise MistillInputError("the hierarchy file must be a JSON object id -> list of broader ids", file=str(p))
    out: dict[str, tuple[str, ...]] = {}
    for cid, broader in data.items():
        rec = Record({"broader": broader}, file=str(p), record=str(cid))
        if str(cid) not in concepts:
            raise rec.fail("not a concept of the concept file", "id")
        ids = rec.texts("broader", ids=True)
        for b in ids:
            if b not in concepts:
                raise rec.fail(f"broader concept {b!r} is not a concept of the concept file", "broader")
        out[str(cid)] = ids
    return out


def micro_f1(scores: Iterable[Mapping[str, float]]) -> float:
    """Micro-F1 pooled from per-act :meth:`EurlexTask.metric` rows (their ``tp``/``fp``/``fn``)."""
    tp = fp = fn = 0
    for s in scores:
        tp, fp, fn = tp + int(s["tp"]), fp + int(s["fp"]), fn + int(s["fn"])
    return prf_from_counts(tp, fp, fn)[2]


class EurlexTask(Task):
    """EuroVoc concept labelling. ``concepts``: id -> label (:func:`load_eurovoc`); ``broader``:
    id -> broader ids (:func:`load_broader`; None: no hierarchy). :attr:`items` maps each label
    to ``"EuroVoc <id>"``."""

    name = "eurlex57k"
    has_p1 = False

    def __init__(self, concepts: Mapping[str, str] | None = None,
                 broader: Mapping[str, Sequence[str]] | None = None) -> None:
        concepts = dict(concepts or {})
        by_label: dict[str, str] = {}
        for cid, label in concepts.items():
            if label in by_label:
                raise MistillInputError(f"label {label!r} names concepts {by_label[label]} and {cid}",
                                        note=str(cid), field="label")
            by_label[label] = cid
        super().__init__({label: f"EuroVoc {cid}" for label, cid in by_label.items()})
        self.concepts = concepts
        self._id_of = by_label
        self._folded = {label.casefold(): label for label in by_label}
        self._broader = {str(k): frozenset(v) for k, v in (broader or {}).items()}

    def label(self, concept_id: str) -> str:
        """The label of a concept id (an unknown id raises, naming it)."""
        if concept_id not in self.concepts:
            raise MistillInputError(f"unknown EuroVoc concept {concept_id!r}", field="concepts")
        return self.concepts[concept_id]

    def gold(self, act: EurlexAct) -> tuple[str, ...]:
        """An act's gold labels; a concept missing from the concept file raises, naming the act."""
        out = []
        for cid in act.concepts:
            if cid not in self.concepts:
                raise MistillInputError(f"concept {cid!r} is not in the concept file", file=act.file or None,
                                        note=act.celex_id, field="concepts")
            out.append(self.concepts[cid])
        return tuple(dict.fromkeys(out))

    def find_mentions(self, text: str, items: Collection[str], start: int = 0,
                      end: int | None = None) -> list[Mention]:
        return whole_word_mentions(text, items, start, end, ignore_case=True)

    def related(self, a: str, b: str) -> bool:
        """``b`` is broader than, narrower than or a sibling of ``a`` (labels)."""
        ia, ib = self._id_of.get(a), self._id_of.get(b)
        if ia is None or ib is None or ia == ib:
            return False
        up_a, up_b = self._broader.get(ia, frozenset()), self._broader.get(ib, frozenset())
        return ib in up_a or ia in up_b or bool(up_a & up_b)

    def parse_answer(self, generation: str) -> tuple[str, ...]:
        part = answer_part(generation)
        entries = last_json_list(part) if part is not None else None
        out: list[str] = []
        for e in entries or ():
            if isinstance(e, int) and not isinstance(e, bool):
                e = str(e)
            if not isinstance(e, str):
                continue
            e = e.strip()
            label = self.concepts.get(e) or self._folded.get(e.casefold())
            if label is not None and label not in out:
                out.append(label)
        return tuple(out)

    def metric(self, gold: Sequence[str], pred: Sequence[str]) -> dict[str, float]:
        """Set counts, precision, recall and F1 of one act (pool with :func:`micro_f1`)."""
        return set_scores(gold, pred)
