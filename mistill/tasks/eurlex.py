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
* **Retrieval baseline** (:meth:`EurlexTask.retrieval_ranking`): the candidates ranked by the
  idf-weighted share of each label's words that the act holds (:func:`lexical_ranking`), whose
  top-5 ``generate`` scores beside the teacher's answer (Table 59's native row).

The stages read the release through :func:`load_eurlex_corpus` (``prepare -P task=eurlex57k``):
every concept of the concept file is an inventory code (its label, described by its id, the
hierarchy recorded as the inventory's relations), each act is a note whose prompt lists its
candidate list (:func:`candidate_list`, **[recon]**: the paper shows the teacher "a candidate
list" without saying how it was drawn), and teacher traces made elsewhere may come with it
(``traces_file``). :func:`write_eurlex_fixture` writes a small release of the project's own in the
release's layout, with scripted traces, on which the stages run in the tests.
"""

from __future__ import annotations

import functools
import json
import math
import random
import re
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from mistill.data.corpus import Corpus, Note
from mistill.data.inventory import Inventory
from mistill.data.prompts import PromptWording
from mistill.errors import MistillInputError
from mistill.evaluation.metrics import prf_from_counts
from mistill.evaluation.parsing import CodeIndex, parse_answer
from mistill.io import read_json
from mistill.tasks.base import Mention, Record, Task, read_traces, set_scores, whole_word_mentions

__all__ = ["EurlexTask", "EurlexAct", "load_eurlex_documents", "load_eurovoc", "load_broader", "micro_f1",
           "EURLEX_WORDING", "candidate_list", "label_words", "lexical_ranking", "load_eurlex_corpus",
           "write_eurlex_fixture", "SPLIT_FOLDERS"]

EURLEX_WORDING = PromptWording(
    header="Below is the list of candidate EuroVoc concepts, one per line: the concept label, then its EuroVoc id.",
    summary_header="Here is the legislative act to label:",
    role_and_task=("You are an experienced documentalist of EU law. Assign EuroVoc concepts to the act above, "
                   "choosing only from the candidate concepts listed above it."),
    narrow_sentence=("Narrow down first to the plausible domains of the list, then decide among the specific "
                     "concepts within them."),
    answer=("Give your final answer as a JSON list of concept labels, with every label written exactly as it "
            "appears in the list."))
"""The prompt's sentences for an act (**[recon]**: the paper gives the task, not its prompt)."""

_WORDS = re.compile(r"[^\W\d_]+")

SPLIT_FOLDERS: Mapping[str, str] = {"train": "train", "dev": "val", "test": "test"}
"""The release's split folders and the corpus splits they become (an act elsewhere is a test act)."""


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
    word_items = True

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

    def answer_index(self, codes: Collection[str]) -> CodeIndex:
        """Labels case-insensitively, and EuroVoc ids (strings or JSON numbers) for their labels:
        the entries :meth:`parse_answer` accepts, over a prepared inventory's labels."""
        return CodeIndex(codes, normalize=str.casefold, aliases=self.concepts, numbers=True)

    @functools.cached_property
    def _index(self) -> CodeIndex:
        return self.answer_index(tuple(self._id_of))

    def parse_answer(self, generation: str) -> tuple[str, ...]:
        return parse_answer(generation, self._index).codes

    def metric(self, gold: Sequence[str], pred: Sequence[str]) -> dict[str, float]:
        """Set counts, precision, recall and F1 of one act (pool with :func:`micro_f1`)."""
        return set_scores(gold, pred)

    @functools.cached_property
    def _word_idf(self) -> dict[str, float]:
        """Each word of the concepts' labels -> its inverse document frequency over the labels,
        ``ln((1 + L) / (1 + l_w)) + 1`` (``L`` labels, ``l_w`` of them holding the word)."""
        held = Counter(w for label in self._id_of for w in _label_words(label))
        n = len(self._id_of)
        return {w: math.log((1 + n) / (1 + c)) + 1.0 for w, c in held.items()}

    def retrieval_ranking(self, text: str, candidates: Sequence[str]) -> tuple[str, ...]:
        """``candidates`` (labels) ranked against an act's ``text`` by :func:`lexical_ranking`
        with the idf of the concept file's labels (**[recon]**: App. P scores "the top-5 of a
        retrieval ranking" without naming the retriever)."""
        return lexical_ranking(text, candidates, self._word_idf)

    def neighbours(self) -> dict[str, frozenset[str]]:
        """Label -> the labels :meth:`related` to it (broader, narrower, siblings), built once from the
        hierarchy rather than by testing every pair."""
        children: dict[str, set[str]] = {}
        for cid, ups in self._broader.items():
            for up in ups:
                children.setdefault(up, set()).add(cid)
        out: dict[str, frozenset[str]] = {}
        for label, cid in self._id_of.items():
            ups = self._broader.get(cid, frozenset())
            ids = set(ups) | children.get(cid, set()) | {s for up in ups for s in children.get(up, ())}
            ids.discard(cid)
            out[label] = frozenset(self.concepts[i] for i in ids if i in self.concepts)
        return out

    @classmethod
    def from_inventory(cls, inventory: Inventory) -> "EurlexTask":
        """The task of a prepared EURLEX corpus (:func:`load_eurlex_corpus`): the inventory's
        labels, their ids (``"EuroVoc <id>"`` descriptions) and its relations as the hierarchy."""
        ids = {label: inventory.descriptions[label].removeprefix("EuroVoc ").strip() for label in inventory.codes}
        return cls({cid: label for label, cid in ids.items()},
                   {ids[label]: [ids[b] for b in broader] for label, broader in inventory.relations.items()})


def label_words(text: str) -> frozenset[str]:
    """The case-folded words (runs of letters) of a label or an act."""
    return frozenset(w.casefold() for w in _WORDS.findall(text))


@functools.lru_cache(maxsize=None)
def _label_words(label: str) -> frozenset[str]:
    """:func:`label_words` of a label, read once per process (every act ranks the same labels)."""
    return label_words(label)


def lexical_ranking(text: str, candidates: Sequence[str], idf: Mapping[str, float]) -> tuple[str, ...]:
    """``candidates`` ordered by how much of each label's words an act's ``text`` holds, best first
    (**[recon]**, a retrieval baseline without training): a label's score is the share of its
    words' idf (``idf``; a word it lacks counts 1) found among the text's words, ties going to the
    larger idf mass found (the more specific label), then to the label in code-point order.
    Duplicates keep their first place."""
    words = label_words(text)
    scored = []
    for label in dict.fromkeys(candidates):
        mine = _label_words(label)
        mass = sum(idf.get(w, 1.0) for w in mine)
        found = sum(idf.get(w, 1.0) for w in mine & words)
        scored.append((-(found / mass) if mass else 0.0, -found, label))
    return tuple(label for _, _, label in sorted(scored))


def candidate_list(gold: Sequence[str], labels: Sequence[str], near: Mapping[str, Collection[str]], size: int,
                   rng: random.Random) -> tuple[str, ...]:
    """An act's candidate list (**[recon]**): its gold labels, then concepts related to them
    (``near``: :meth:`EurlexTask.neighbours`, the near-misses a reasoning contrasts), then other
    concepts of ``labels`` drawn at random, up to ``size`` labels (never fewer than the gold), in a
    shuffled order."""
    chosen = list(dict.fromkeys(gold))
    seen = set(chosen)
    size = min(size, len(labels))  # never more than there are (the gold are labels too)
    related = sorted({x for g in chosen for x in near.get(g, ()) if x not in seen})
    rng.shuffle(related)
    for x in related[:max(0, size - len(chosen))]:
        chosen.append(x)
        seen.add(x)
    if size - len(chosen) >= len(labels) - len(seen):  # every other label fits
        rest = [x for x in labels if x not in seen]
        rng.shuffle(rest)
        chosen += rest
    while len(chosen) < size:  # a few of many: draw and skip the ones already listed
        x = labels[rng.randrange(len(labels))]
        if x not in seen:
            chosen.append(x)
            seen.add(x)
    rng.shuffle(chosen)
    return tuple(chosen)


def _split_of(act: EurlexAct) -> str:
    return SPLIT_FOLDERS.get(Path(act.file).parent.name, "test") if act.file else "test"


def load_eurlex_corpus(dataset: str | Path, concepts_file: str | Path, *, hierarchy_file: str | Path = "",
                       traces_file: str | Path = "", candidates: int = 20, seed: int = 0, order_seed: int = 0,
                       name: str = "eurlex57k", privacy: str = "public") -> Corpus:
    """The acts below ``dataset`` (the release's ``dataset`` folder, or any folder or file of act
    documents) as a corpus: one note per act (its CELEX id; split from its folder,
    :data:`SPLIT_FOLDERS`), its gold labels, its :func:`candidate_list` of ``candidates`` labels as
    the prompt's list (seeded by ``seed`` and the act), and its trace from ``traces_file`` (JSONL
    rows ``{"celex_id", "trace"}``) when given. The inventory holds every concept of
    ``concepts_file`` (labels in a ``random.Random(order_seed)`` shuffle of their sorted order) with
    the hierarchy of ``hierarchy_file`` as its relations. An act without a concept, a trace for an
    unknown act or a malformed record raises, naming the file, the act and the field."""
    if candidates < 1:
        raise MistillInputError(f"candidates must be at least 1, not {candidates}", field="candidates")
    concepts = load_eurovoc(concepts_file)
    broader = load_broader(hierarchy_file, concepts) if hierarchy_file else {}
    task = EurlexTask(concepts, broader)
    labels = sorted(task.items)
    order = list(labels)
    random.Random(order_seed).shuffle(order)
    label_of = task.concepts
    relations = {label_of[c]: tuple(label_of[b] for b in ups) for c, ups in broader.items() if ups}
    inventory = Inventory(codes=tuple(order), descriptions=dict(task.items), order_seed=order_seed,
                          source=f"EURLEX57K concepts ({Path(concepts_file).name})", task=task.name,
                          relations=relations)
    acts = load_eurlex_documents(dataset)
    traces = read_traces(traces_file, "celex_id", {a.celex_id for a in acts}, "an act") if traces_file else {}
    near = task.neighbours()
    notes = []
    for act in acts:
        gold = task.gold(act)
        if not gold:
            raise MistillInputError("the act has no EuroVoc concept", file=act.file or None, note=act.celex_id,
                                    field="concepts")
        shown = candidate_list(gold, labels, near, candidates, random.Random(f"{seed}:{act.celex_id}"))
        notes.append(Note(note_id=act.celex_id, patient_id=act.celex_id, split=_split_of(act), text=act.text,
                          gold_codes=gold, teacher_trace=traces.get(act.celex_id),
                          meta={"source": "EURLEX57K", "file": Path(act.file).name if act.file else ""},
                          shortlist=shown))
    return Corpus(name=name, privacy=privacy, notes=notes, inventory=inventory,
                  meta={"task": task.name, "candidates": candidates, "seed": seed})


_FIXTURE_DOMAINS: tuple[tuple[str, str, tuple[tuple[str, str], ...]], ...] = (
    ("100", "agricultural policy", (("101", "plant health"), ("102", "animal health"), ("103", "crop production"))),
    ("200", "trade policy", (("201", "customs duties"), ("202", "import licence"), ("203", "export refund"))),
    ("300", "environmental policy", (("301", "water pollution"), ("302", "air quality"), ("303", "waste management"))),
    ("400", "transport policy", (("401", "road safety"), ("402", "rail transport"), ("403", "maritime transport"))),
)


def write_eurlex_fixture(folder: str | Path, *, acts_per_split: Mapping[str, int] | None = None,
                         seed: int = 0) -> dict[str, Path]:
    """A small release of the project's own in EURLEX57K's layout under ``folder``: invented acts
    in ``dataset/{train,dev,test}/<celex>.json``, 16 concepts of four domains in ``EURLEX57K.json``,
    their hierarchy in ``broader.json``, and a scripted teacher trace per act in ``traces.jsonl``
    (prose, a gold concept, a sibling of it, the other gold concept, and the gold labels as the
    answer). Returns the paths by role (``dataset``, ``concepts_file``,
    ``hierarchy_file``, ``traces_file``)."""
    root = Path(folder)
    counts = dict(acts_per_split or {"train": 6, "dev": 3, "test": 3})
    concepts = {cid: {"label": label} for cid, label, _ in _FIXTURE_DOMAINS}
    broader: dict[str, list[str]] = {}
    for cid, _, children in _FIXTURE_DOMAINS:
        for child_id, child in children:
            concepts[child_id] = {"label": child}
            broader[child_id] = [cid]
    rng = random.Random(seed)
    traces = []
    for split, n in counts.items():
        (root / "dataset" / split).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            celex = f"3{2000 + seed}R{len(traces) + 1:04d}"
            (d1, _, kids1), (d2, _, kids2) = rng.sample(_FIXTURE_DOMAINS, 2)
            (g1_id, g1), (near_id, near) = rng.sample(kids1, 2)
            g2_id, g2 = rng.choice(kids2)
            body = [f"Article 1. This Regulation lays down rules on {g1} within the Union.",
                    f"Article 2. Member States shall report on {g2} each year."]
            doc = {"celex_id": celex, "title": f"Commission Regulation on {g1} and {g2}",
                   "header": "THE EUROPEAN COMMISSION,", "recitals": f"Whereas measures on {g1} are needed,",
                   "main_body": body, "attachments": "", "concepts": [g1_id, g2_id]}
            (root / "dataset" / split / f"{celex}.json").write_text(json.dumps(doc, indent=1), encoding="utf-8")
            trace = ("<think>First I read the title and the articles to see what the act regulates. The recitals "
                     "explain why the measures are needed and which duties they create for the Member States. "
                     f"The act lays down rules on {g1}. It is close to {near}, but the articles concern {g1}. "
                     "The second article then adds a yearly reporting duty for every Member State, which "
                     f"points to {g2}. Nothing else in the act needs a concept of its own, so the answer has "
                     f"two labels.</think>\n{json.dumps([g1, g2])}")
            traces.append({"celex_id": celex, "trace": trace})
    paths = {"dataset": root / "dataset", "concepts_file": root / "EURLEX57K.json",
             "hierarchy_file": root / "broader.json", "traces_file": root / "traces.jsonl"}
    paths["concepts_file"].write_text(json.dumps(concepts, indent=1), encoding="utf-8")
    paths["hierarchy_file"].write_text(json.dumps(broader, indent=1), encoding="utf-8")
    paths["traces_file"].write_text("".join(json.dumps(t) + "\n" for t in traces), encoding="utf-8")
    return paths
