"""What the tokens around a locus are (paper App. F, "What the locus token is", Table 27).

Trace tokens are classed by the word they belong to:

- ``own_description``: a word of the emitted code's own inventory description;
- ``chapter_description``: a word of another description in the emitted code's chapter;
- ``other_description``: a word of a description in another chapter;
- ``code``: part of a code string (an inventory mention or any run shaped like a code);
- ``punctuation``: no letter or digit;
- ``prose``: anything else.

Description words are lower-cased runs of at least four letters, without the structural words
of the inventory's phrasing (:data:`STRUCTURAL_WORDS`, **[recon]**: the paper removes "words
such as 'unspecified'" without listing them). A word that belongs to several classes takes the
first in the order above.

Also here: the token positions of mentions (:func:`mention_token_spans`) and the end of the
code mentioned just before a chapter mention (:func:`previous_code_end`), the boundary between
a locus in the reasoning window and an inherited one.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable, Mapping, Sequence

from mistill.data.inventory import Inventory

__all__ = ["TOKEN_CLASSES", "STRUCTURAL_WORDS", "description_words", "DescriptionWords",
           "classify_tokens", "mention_token_spans", "previous_code_end", "char_to_token", "class_shares"]

TOKEN_CLASSES: tuple[str, ...] = ("own_description", "chapter_description", "other_description", "code",
                                  "punctuation", "prose")

STRUCTURAL_WORDS: frozenset[str] = frozenset({
    "unspecified", "specified", "other", "without", "with", "elsewhere", "classified", "type",
    "site", "side", "part", "unknown", "initial", "subsequent", "encounter", "sequela", "than",
    "from", "into", "complicating", "involving", "their", "this", "that", "except", "mention",
    "unilateral", "bilateral", "right", "left", "both"})
"""**[recon]** Words of the inventory's phrasing that name no condition (laterality, encounter,
"unspecified"...): never description words."""

_WORD = re.compile(r"[A-Za-z]+")
_ALNUM = re.compile(r"[^\W_]")
_CODE_SHAPE = re.compile(r"[A-Z][0-9][0-9A-Z](?:\.?[0-9A-Z]{1,4})?")


def description_words(text: str, *, min_letters: int = 4,
                      structural: Iterable[str] = STRUCTURAL_WORDS) -> frozenset[str]:
    """Lower-cased words of ``text`` with at least ``min_letters`` letters, structural words removed."""
    drop = set(structural)
    return frozenset(w for w in (m.group(0).lower() for m in _WORD.finditer(text))
                     if len(w) >= min_letters and w not in drop)


class DescriptionWords:
    """The description words of every inventory code, by code and by chapter letter."""

    def __init__(self, inventory: Inventory, *, min_letters: int = 4) -> None:
        self.by_code: dict[str, frozenset[str]] = {
            c: description_words(inventory.description(c), min_letters=min_letters) for c in inventory}
        chapters: dict[str, set[str]] = {}
        for c, words in self.by_code.items():
            chapters.setdefault(c[0], set()).update(words)
        self.by_chapter: dict[str, frozenset[str]] = {k: frozenset(v) for k, v in chapters.items()}
        self.all_words: frozenset[str] = frozenset().union(*self.by_code.values()) if self.by_code else frozenset()

    def classes_for(self, code: str) -> tuple[frozenset[str], frozenset[str], frozenset[str]]:
        """``(own, same chapter, other chapters)`` word sets for an emitted ``code``."""
        own = self.by_code.get(code, frozenset())
        chapter = self.by_chapter.get(code[0], frozenset()) - own
        other = self.all_words - own - chapter
        return own, chapter, other


def _word_at(text: str, start: int, end: int) -> str:
    """The alphabetic word overlapping ``text[start:end]`` (extended to its boundaries), or ''."""
    for m in _WORD.finditer(text, max(0, start - 64), min(len(text), end + 64)):
        if m.start() < end and m.end() > start:
            return m.group(0).lower()
    return ""


def classify_tokens(full_text: str, offsets: Sequence[tuple[int, int]], positions: Sequence[int], code: str,
                    words: DescriptionWords, code_spans: Sequence[tuple[int, int]]) -> list[str]:
    """The class (one of :data:`TOKEN_CLASSES`) of each token at ``positions``.

    Args:
        full_text: the text the ``offsets`` (character spans, one per token) index.
        positions: token positions to class.
        code: the emitted code of the decision the tokens precede.
        code_spans: character spans (in ``full_text``) of code mentions; runs shaped like an
            ICD-10-CM code are found here too.
    """
    own, chapter, other = words.classes_for(code)
    spans = sorted(code_spans) + [(m.start(), m.end()) for m in _CODE_SHAPE.finditer(full_text)]
    spans.sort()
    starts = [s for s, _ in spans]
    out = []
    for p in positions:
        s, e = offsets[p]
        piece = full_text[s:e]
        i = bisect.bisect_right(starts, max(s, e - 1)) - 1
        in_code = any(a < e and b > s for a, b in spans[max(0, i - 2):i + 1]) if e > s else False
        if in_code:
            out.append("code")
            continue
        if not _ALNUM.search(piece):
            out.append("punctuation")
            continue
        w = _word_at(full_text, s, e)
        out.append("own_description" if w in own else "chapter_description" if w in chapter
                   else "other_description" if w in other else "prose")
    return out


def char_to_token(offsets: Sequence[tuple[int, int]], char: int) -> int:
    """The last token starting at or before character ``char`` (-1 if none)."""
    starts = [s for s, _ in offsets]
    return bisect.bisect_right(starts, char) - 1


def mention_token_spans(offsets: Sequence[tuple[int, int]], mentions: Sequence[tuple[str, int, int]],
                        trace_offset: int) -> list[tuple[str, int, int]]:
    """``(code, first token, last token)`` of each mention ``(code, start, end)`` given in trace
    characters (end exclusive), for a tokenization of the full text whose trace starts at
    character ``trace_offset``."""
    out = []
    for code, start, end in mentions:
        first = max(0, char_to_token(offsets, trace_offset + start))
        last = max(first, char_to_token(offsets, trace_offset + end - 1))
        out.append((code, first, last))
    return out


def previous_code_end(mention_tokens: Sequence[tuple[str, int, int]], first_token: int) -> int | None:
    """The last token of the code mentioned just before a mention that starts at token
    ``first_token`` (any code, any chapter); None for the first code of the trace."""
    ends = [last for _, first, last in mention_tokens if first < first_token]
    return max(ends) if ends else None


def class_shares(classes: Sequence[str]) -> Mapping[str, float]:
    """Share of each class among ``classes`` (0 for an empty list)."""
    n = len(classes)
    return {c: (sum(1 for x in classes if x == c) / n if n else 0.0) for c in TOKEN_CLASSES}
