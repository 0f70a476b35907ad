"""The retrieved shortlist of App. A: fused retrieval, sibling completion, the K rule, and the
retriever-alone baseline (Table 44).

The retriever reads a note as chunks of whitespace words, embedded by a frozen sentence encoder
(:mod:`mistill.models.encoder`). Two scores per inventory code:

- the **head**: a multi-label logistic regression (:mod:`mistill.models.linear_head`) on the
  note's ``[max; mean]``-pooled chunk embeddings, trained on notes whose patients are disjoint
  from every evaluated corpus;
- the **zero-shot** similarity: the largest cosine similarity between any chunk of the note and
  the code's description.

**Fusion** (``fusion`` parameter), per note over the inventory, with ``w = fusion_weight``:

- ``"rrf"`` (weighted reciprocal-rank fusion):
  ``w / (rrf_k + rank_head(c)) + (1 - w) / (rrf_k + rank_zero_shot(c))``, ranks from 1;
- ``"zsum"`` (weighted sum of standardised scores):
  ``w * z(head logit) + (1 - w) * z(similarity)``, each standardised over the codes of the note
  (a constant score row standardises to zeros).

``w = 1`` is the head alone, ``w = 0`` zero-shot alone. Every ranking sorts by score,
descending, and breaks exact ties by inventory order, so it is a deterministic function of the
scores. The scores of a note are themselves batch-invariant: its chunks are encoded on their own,
and the head scores each note row by the same float64 arithmetic
(:meth:`~mistill.models.linear_head.LinearHead.logits`), so a note's scores, and so its ranking,
are bit-identical whether it is scored alone or in any batch, at any position.

**Completion**: the top ``K`` codes of the fused ranking, then the category siblings (same
first three characters) of the first ``min(K, siblings_of)`` codes that are not already kept,
appended in fused-rank order. The same construction serves training, validation and test.

**Recall** here is code-level macro recall: for each distinct gold code of a note set, the
share of the notes coding it whose list contains it, averaged over those codes. Micro (pooled)
recall is reported beside it.

**The K rule** (pre-registered): the smallest ``K`` of the sweep whose completed recall reaches
``target`` on both the validation notes and the whole corpus.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mistill.data.corpus import Note
from mistill.data.inventory import Inventory, category
from mistill.data.prompts import remove_section
from mistill.errors import MistillInputError
from mistill.evaluation.metrics import task_metrics
from mistill.models.encoder import chunk_words
from mistill.models.linear_head import train_linear_head
from mistill.progress import track

__all__ = [
    "DEFAULT_K_GRID",
    "FUSION_RULES",
    "Retriever",
    "RetrieverSettings",
    "baseline_rows",
    "complete_with_siblings",
    "fuse_scores",
    "k_grid_for",
    "label_matrix",
    "macro_code_recall",
    "micro_recall",
    "pool_chunks",
    "rank_desc",
    "recall_sweep",
    "retriever_text",
    "select_k",
    "split_training_notes",
    "zero_shot_scores",
]

FUSION_RULES = ("rrf", "zsum")
DEFAULT_K_GRID = (10, 20, 30, 40, 50, 60, 80, 100, 150, 200, 300, 400, 500, 600, 700, 800, 900,
                  1000, 1250, 1500, 2000, 2500, 3000, 4000, 5000)


# ---------------------------------------------------------------------------------------------
# Scores


def retriever_text(note: Note, remove_discharge_diagnosis: bool) -> str:
    """The note as the retriever reads it: as the prompt shows it (discharge-diagnosis section
    removed when the prompt removes it)."""
    if remove_discharge_diagnosis and note.discharge_diagnosis:
        return remove_section(note.text, note.discharge_diagnosis, note_id=note.note_id)
    return note.text


def pool_chunks(chunks: torch.Tensor) -> torch.Tensor:
    """``[n_chunks, d] -> [2d]``: the element-wise max, then the mean, over a note's chunks."""
    if chunks.ndim != 2 or chunks.shape[0] == 0:
        raise MistillInputError(f"a note needs at least one chunk embedding, got shape "
                                f"{tuple(chunks.shape)}", field="chunks")
    return torch.cat([chunks.max(0).values, chunks.mean(0)])


def zero_shot_scores(chunks: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """``chunks [n_chunks, d]``, ``codes [n_codes, d]`` (unit rows) ``-> [n_codes]``: for each
    code, its description's largest cosine similarity with any chunk."""
    return (chunks @ codes.T).max(0).values


def rank_desc(scores: np.ndarray) -> np.ndarray:
    """``[n, c] -> [n, c]`` column indices by descending score; exactly equal scores keep index
    (inventory) order, a stable sort being the explicit tie rule."""
    scores = np.asarray(scores, dtype=np.float64)
    return np.argsort(-scores, axis=-1, kind="stable")


def _ranks(scores: np.ndarray) -> np.ndarray:
    """``[n, c]`` 1-based rank of every entry in its row (ties in index order)."""
    order = rank_desc(scores)
    ranks = np.empty_like(order)
    rows = np.arange(order.shape[0])[:, None]
    ranks[rows, order] = np.arange(1, order.shape[1] + 1)[None, :]
    return ranks


def _standardise(scores: np.ndarray) -> np.ndarray:
    mean = scores.mean(-1, keepdims=True)
    std = scores.std(-1, keepdims=True)
    return np.where(std > 0, (scores - mean) / np.where(std > 0, std, 1.0), 0.0)


def fuse_scores(head: np.ndarray, zero_shot: np.ndarray, *, rule: str = "rrf",
                weight: float = 0.5, rrf_k: float = 60.0) -> np.ndarray:
    """Fused score ``[n, c]`` of the head's ``[n, c]`` and the zero-shot ``[n, c]`` (module doc)."""
    head = np.atleast_2d(np.asarray(head, dtype=np.float64))
    zero_shot = np.atleast_2d(np.asarray(zero_shot, dtype=np.float64))
    if head.shape != zero_shot.shape:
        raise MistillInputError(f"head scores {head.shape} and zero-shot scores "
                                f"{zero_shot.shape} differ in shape", field="scores")
    if not 0.0 <= weight <= 1.0:
        raise MistillInputError(f"fusion_weight must lie in [0, 1], got {weight}",
                                field="fusion_weight")
    if rule == "rrf":
        if rrf_k < 0:
            raise MistillInputError("rrf_k must be >= 0", field="rrf_k")
        return weight / (rrf_k + _ranks(head)) + (1 - weight) / (rrf_k + _ranks(zero_shot))
    if rule == "zsum":
        return weight * _standardise(head) + (1 - weight) * _standardise(zero_shot)
    raise MistillInputError(f"unknown fusion rule {rule!r} (one of {FUSION_RULES})",
                            field="fusion")


# ---------------------------------------------------------------------------------------------
# Completion and recall


def complete_with_siblings(ranked: Sequence[str], k: int, siblings_of: int,
                           inventory: Inventory) -> list[str]:
    """The shortlist of one note: ``ranked[:k]`` then the category siblings of its first
    ``min(k, siblings_of)`` codes not yet kept, in ``ranked`` order (inventory order for any
    sibling ``ranked`` lacks)."""
    if k < 1:
        raise MistillInputError(f"K must be positive, got {k}", field="k")
    top = list(ranked[:k])
    kept = set(top)
    cats = {category(c) for c in top[:max(0, min(k, siblings_of))]}
    extra = [c for c in ranked[k:] if category(c) in cats and c not in kept]
    kept.update(extra)
    extra += [c for c in inventory.codes if category(c) in cats and c not in kept]
    return top + extra


def macro_code_recall(lists: Sequence[Iterable[str]], gold: Sequence[Iterable[str]]) -> float:
    """Code-level macro recall: per distinct gold code, the share of the notes coding it whose
    list holds it; the mean over codes (NaN with no gold code)."""
    if len(lists) != len(gold):
        raise MistillInputError(f"{len(lists)} lists for {len(gold)} notes", field="gold")
    coded: Counter[str] = Counter()
    found: Counter[str] = Counter()
    for lst, g in zip(lists, gold):
        have = set(lst)
        for c in set(g):
            coded[c] += 1
            found[c] += c in have
    return float(np.mean([found[c] / coded[c] for c in coded])) if coded else math.nan


def micro_recall(lists: Sequence[Iterable[str]], gold: Sequence[Iterable[str]]) -> float:
    """Pooled recall of the gold codes over notes (NaN with no gold code)."""
    hit = total = 0
    for lst, g in zip(lists, gold):
        gs = set(g)
        hit += len(gs & set(lst))
        total += len(gs)
    return hit / total if total else math.nan


def k_grid_for(n_codes: int, grid: Sequence[int] = ()) -> tuple[int, ...]:
    """The sweep's K values: ``grid`` (or :data:`DEFAULT_K_GRID`) below ``n_codes``, then
    ``n_codes`` itself (a shortlist of the whole inventory is always a candidate)."""
    grid = tuple(grid) or DEFAULT_K_GRID
    if any(int(k) < 1 for k in grid):
        raise MistillInputError(f"every K of the grid must be positive: {grid}", field="k_grid")
    return tuple(sorted({int(k) for k in grid if k < n_codes} | {n_codes}))


def recall_sweep(ranked: Sequence[Sequence[str]], gold: Sequence[Sequence[str]],
                 inventory: Inventory, ks: Sequence[int], siblings_of: int):
    """One row per K: ``k, recall, recall_completed, micro_recall, micro_recall_completed,
    mean_len_completed`` over the notes given (``ranked``: each note's fused ranking)."""
    import pandas as pd  # deferred: pandas is slow to import

    rows = []
    for k in ks:
        plain = [r[:k] for r in ranked]
        done = [complete_with_siblings(r, k, siblings_of, inventory) for r in ranked]
        rows.append({"k": int(k), "recall": macro_code_recall(plain, gold),
                     "recall_completed": macro_code_recall(done, gold),
                     "micro_recall": micro_recall(plain, gold),
                     "micro_recall_completed": micro_recall(done, gold),
                     "mean_len_completed": float(np.mean([len(d) for d in done])) if done
                     else math.nan})
    return pd.DataFrame(rows)


def select_k(sweep, target: float, columns: Sequence[str]) -> dict:
    """The pre-registered K rule on a sweep table (``k`` and the completed-recall ``columns``,
    one per note set): the smallest K whose recall reaches ``target`` in every column.

    A column that is all NaN (an empty note set) does not bind and is listed under ``skipped``.
    When no K qualifies, the largest K is returned with ``reached`` False.
    """
    if not 0 < target <= 1:
        raise MistillInputError(f"target recall must lie in (0, 1], got {target}",
                                field="target_recall")
    if len(sweep) == 0:
        raise MistillInputError("empty K sweep", field="k_grid")
    used = [c for c in columns if not sweep[c].isna().all()]
    skipped = [c for c in columns if c not in used]
    if not used:
        raise MistillInputError("no note set to apply the K rule to (every recall is NaN)",
                                field="val_split")
    table = sweep.sort_values("k")
    ok = np.ones(len(table), dtype=bool)
    for c in used:
        ok &= (table[c].to_numpy() >= target)
    reached = bool(ok.any())
    row = table[ok].iloc[0] if reached else table.iloc[-1]
    binding = [c for c in used if reached and _first_k(table, c, target) == int(row["k"])]
    return {"k": int(row["k"]), "reached": reached, "target": float(target), "columns": used,
            "skipped": skipped, "binding": binding,
            "recall_at_k": {c: float(row[c]) for c in used},
            "rule": "smallest K of the sweep whose completed code-level macro recall reaches "
                    "the target on every note set"}


def _first_k(table, column: str, target: float) -> int | None:
    hit = table[table[column] >= target]
    return int(hit["k"].iloc[0]) if len(hit) else None


# ---------------------------------------------------------------------------------------------
# The retriever-alone baseline (Table 44)


def baseline_rows(shortlists: Sequence[Sequence[str]], gold: Sequence[Sequence[str]],
                  ks: Sequence[int], *, train_freq: Mapping[str, int] | None = None,
                  n_train: int | None = None):
    """The retriever alone as the prediction: the first ``k`` codes of each note's (ranked)
    shortlist for every ``k`` no longer than the longest shortlist, and the whole shortlist,
    scored with :func:`mistill.evaluation.metrics.task_metrics`. One row each (``k`` is -1 for
    the whole shortlist)."""
    import pandas as pd  # deferred: pandas is slow to import

    longest = max((len(s) for s in shortlists), default=0)
    preds = [(f"first {k}", int(k), [list(s[:k]) for s in shortlists])
             for k in sorted(set(ks)) if 0 < k <= longest]
    preds.append(("whole shortlist", -1, [list(s) for s in shortlists]))
    rows = []
    for name, k, pred in preds:
        m = task_metrics(gold, pred, train_freq=train_freq, n_train=n_train)
        rows.append({"prediction": name, "k": k, "mean_n_pred": float(np.mean([len(p) for p in pred])),
                     **m})
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------------------------
# Training data


def split_training_notes(notes: Iterable[Note], excluded_patients: Iterable[str]
                         ) -> tuple[list[Note], list[Note]]:
    """``(kept, dropped)``: the notes whose patient is not excluded, and the others."""
    excluded = set(excluded_patients)
    kept, dropped = [], []
    for n in notes:
        (dropped if n.patient_id in excluded else kept).append(n)
    return kept, dropped


def label_matrix(notes: Sequence[Note], inventory: Inventory) -> torch.Tensor:
    """``[n_notes, n_codes]`` 0/1 float: gold codes in inventory order (others ignored)."""
    y = torch.zeros(len(notes), len(inventory))
    for i, n in enumerate(notes):
        for c in n.gold_codes:
            if c in inventory:
                y[i, inventory.index(c)] = 1.0
    return y


# ---------------------------------------------------------------------------------------------
# The retriever


@dataclass(frozen=True)
class RetrieverSettings:
    """How notes are read, the head trained and the scores fused (see the module doc)."""

    chunk_words: int = 128
    batch_size: int = 32
    remove_discharge_diagnosis: bool = True
    fusion: str = "rrf"
    fusion_weight: float = 0.5
    rrf_k: float = 60.0
    l2: float = 1e-3
    lr: float = 1e-2
    epochs: int = 200
    head_batch_size: int = 512
    seed: int = 0


class Retriever:
    """Encoder, code-description embeddings and the trained head, for one inventory."""

    def __init__(self, encoder, inventory: Inventory, settings: RetrieverSettings) -> None:
        if settings.fusion not in FUSION_RULES:
            raise MistillInputError(f"unknown fusion rule {settings.fusion!r} (one of "
                                    f"{FUSION_RULES})", field="fusion")
        self.encoder = encoder
        self.inventory = inventory
        self.settings = settings
        self.code_emb = encoder.encode([inventory.description(c) for c in inventory.codes],
                                       batch_size=settings.batch_size, progress="descriptions")
        # [n_codes, d] unit rows, inventory order
        self.head = None
        self.train_note_ids: tuple[str, ...] = ()

    def note_chunks(self, note: Note) -> list[str]:
        """The note's chunks of ``chunk_words`` words (the text as the prompt shows it)."""
        pieces = chunk_words(retriever_text(note, self.settings.remove_discharge_diagnosis),
                             self.settings.chunk_words)
        if not pieces:
            raise MistillInputError("note has no words to retrieve from", note=note.note_id,
                                    field="text")
        return pieces

    def features(self, notes: Sequence[Note], *, zero_shot: bool = True, desc: str = "notes"
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(x [n_notes, 2d], zero-shot [n_notes, n_codes] or None)``.

        Each note's chunks are encoded on their own (never batched with another note's), so a
        note's scores depend on that note alone, whichever corpus or split it is read in; only
        the pooled features and the zero-shot row are kept, not the chunk embeddings.
        """
        xs, zs = [], []
        for note in track(notes, desc=desc, leave=False):
            emb = self.encoder.encode(self.note_chunks(note), batch_size=self.settings.batch_size)
            xs.append(pool_chunks(emb))
            if zero_shot:
                zs.append(zero_shot_scores(emb, self.code_emb))
        if not xs:
            raise MistillInputError("no notes to embed", field="notes")
        return torch.stack(xs), (torch.stack(zs) if zero_shot else None)

    def fit(self, train_notes: Sequence[Note], excluded_patients: Iterable[str] = ()) -> None:
        """Train the head on ``train_notes``; a note of an excluded patient raises (callers
        filter with :func:`split_training_notes` first)."""
        excluded = set(excluded_patients)
        for n in train_notes:
            if n.patient_id in excluded:
                raise MistillInputError("a training note belongs to an excluded patient",
                                        note=n.note_id, field="patient_id")
        if not train_notes:
            raise MistillInputError("no training notes left for the linear head (every "
                                    "candidate's patient is excluded?)", field="train")
        x, _ = self.features(train_notes, zero_shot=False, desc="train notes")
        y = label_matrix(train_notes, self.inventory)
        s = self.settings
        self.head = train_linear_head(x, y, l2=s.l2, lr=s.lr, epochs=s.epochs,
                                      batch_size=s.head_batch_size, seed=s.seed)
        self.train_note_ids = tuple(n.note_id for n in train_notes)

    def scores(self, notes: Sequence[Note]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(head, zero_shot, fused)``, each ``[n_notes, n_codes]`` float64 in inventory order.

        Row ``i`` is a function of ``notes[i]`` alone, computed by the same arithmetic whatever
        the other notes (features per note, head logits per row, fusion per row).
        """
        if self.head is None:
            raise RuntimeError("Retriever.fit() first")
        x, zero = self.features(notes)
        head = self.head.logits(x).numpy().astype(np.float64)
        zs = zero.numpy().astype(np.float64)
        s = self.settings
        return head, zs, fuse_scores(head, zs, rule=s.fusion, weight=s.fusion_weight, rrf_k=s.rrf_k)

    def rank(self, notes: Sequence[Note]) -> list[list[str]]:
        """Each note's fused ranking of the whole inventory (best first)."""
        fused = self.scores(notes)[2]
        codes = self.inventory.codes
        return [[codes[j] for j in row] for row in rank_desc(fused)]
