"""The privacy guard: note and trace text never reaches MLflow for a restricted corpus.

A corpus carries one of three privacy levels (:data:`PRIVACY_LEVELS`). For ``"synthetic"`` and
``"public"`` corpora the guard allows everything. For ``"restricted"`` corpora (e.g. MIMIC-IV under
credentialed access) every string on its way to the tracking store -- param values, tag keys and
values, metric names, dataset cells, artifact files -- is checked against the protected texts (the
notes and the traces written about them) and refused with :class:`PrivacyError` when it contains
any of them.

**Normalisation.** Protected texts and candidates go through the same :func:`normalise`, so a
sentence is found however it was re-wrapped, re-cased, escaped or disguised:

* escapes are undone, repeatedly (at most :data:`MAX_DECODE_ROUNDS` rounds, so double encoding
  is undone too): JSON/Python ``\\n`` and ``\\u00e9`` (surrogate pairs joined), HTML entities
  (``&nbsp;``, ``&#122;``) and URL percent-encoding (``%20``; ``+`` is a separator anyway);
* Unicode compatibility folding (NFKD: full-width and mathematical letters, ligatures and
  superscripts become plain letters) with combining marks dropped (``é`` -> ``e``);
* invisible characters -- format characters (category Cf: zero-width space and joiners, word
  joiner, BOM, soft hyphen, tag characters) and control characters other than whitespace --
  may hide inside a word (``t\\u200bhe``) or stand for a space (``the\\u200bzebra``): protected
  texts are read with them dropped; a candidate holding any is read both ways (two token
  streams instead of one). The blank Hangul filler letters become spaces;
* lookalike letters are folded by the explicit table :data:`CONFUSABLES`: the Cyrillic, Greek
  (and a few Armenian and Latin) letters that render like a Latin letter, upper- and lower-case
  separately (Cyrillic ``а е о р с х у і`` -> Latin ``a e o p c x y i``). It is deliberately small:
  the full Unicode confusables list is not used;
* camelCase is split (``theZebraCanary`` -> ``the Zebra Canary``; ``HTMLParser`` -> ``HTML Parser``),
  then the text is case-folded;
* words are the runs of letters and digits: ``_``, ``-``, ``.``, ``/``, ``+``, quotes, markup and
  every other non-alphanumeric character separate words (``\\w`` would keep ``_`` inside a word).

A candidate is normalised once, to one token stream (two when it holds invisible characters:
still linear). A protected text containing a camelCase boundary of its own (``IgG``,
``mmHg``, ``McDonald``) is indexed twice, split and unsplit, so a candidate that re-cases it
(``MMHG``) is found as well as one that copies it.

**Detection.** Two hashed indexes, each a few sorted ``uint64`` arrays searched with
``searchsorted``:

* word 6-grams (:data:`NGRAM`): every 6-gram of every protected text (a polynomial over per-word
  hashes, vectorised with numpy); a candidate is refused when one of its 6-grams is indexed;
* glued letters (:data:`CHAR_WINDOW`): the separator-free letter stream of each protected text
  (its words concatenated), hashed in windows of 40 characters that start at a word start
  (one window per word, so this index is no larger than the 6-gram one). Every 40-character
  window of a candidate's letter stream is looked up, so words glued together in any way
  (``thezebracanarywalked...``, ``THEZEBRA...``, words split inside by markup tags) are refused
  once the glued run holds 40 letters of a protected text from one of its word starts on.
  **Limit:** a glued run shorter than that (about eight words) is not detected.

Windows and 6-grams never span a label code (below); 6-grams made only of numbers and windows
made only of digits are not indexed (numbers alone are not text, and numeric artifacts --
metrics, arrays, counts -- would collide with them). Protected texts shorter than six words are
matched as whole word sequences when their normalised form is at least :data:`MIN_SHORT_CHARS`
characters long (shorter ones are too common to mean anything).

ICD-10-CM code shapes (``N18.9``, ``T07.XXXD``) are public labels: they split a text into runs,
and no 6-gram or window crosses one, so a list of gold codes in a trace's order is not refused.
Public texts (e.g. the descriptions of the label inventory, which notes may quote verbatim) can be
passed as ``public_texts``: their 6-grams and letter windows are removed from the protected index,
so a table of codes and descriptions is not refused because a note repeats a description.

**Files** (:meth:`PrivacyGuard.check_file`): text types (:data:`TEXT_SUFFIXES`) are scanned as
text, markup also with its tags removed; JSON/JSONL also by their strings joined in document
order (word and token lists). ``.npy``/``.npz`` string arrays are scanned, numeric ones allowed,
object arrays refused; ``.pt``/``.pth``/``.bin`` are loaded with ``torch.load(weights_only=True)``
(no code runs) and every string in them (dict keys, lists, tuples) is scanned, tensors allowed,
and one that cannot be loaded that way is refused; ``.safetensors`` have their JSON header
scanned (tensor names and ``__metadata__``), tensor data allowed; ``.model`` (sentencepiece
protobuf) is scanned for the strings it stores. Any other file is scanned if it is UTF-8 text and
refused otherwise (images, archives, pickles: text inside them cannot be read). Numeric tensors
and arrays are never read as text, with one exception: byte arrays (``uint8``/``int8``
numpy arrays, and JSON or pickled lists of at least 16 integers in 0..255) are read as UTF-8.

**Casual disguises.** Besides the original, a candidate is also read reversed (character order,
``tneitap eht``), with doubled words collapsed (``the the patient patient``) when at least
three words are doubled, with leetspeak undone (``0 1 3 4 5 7 @ $ ! |`` as ``o i e a s t a s i
l``) when one of them stands between letters, and every base64 (standard or URL-safe) run of at
least 32 characters is decoded and read too, recursively twice. Each is one more linear pass.
A text over :data:`ALWAYS_DISGUISED_CHARS` is read reversed only when it holds a reversed common
word (``eht``, ``dna``, ...), and with doubled words collapsed only when a tenth of its words
are doubled, so that large artifacts are scanned in about one pass.

Cost is linear in the text size: a few C-level passes for normalisation, one hash per word and
per character, a binary search per hash. Protected texts added one at a time (a trace after each
generation) go into sorted runs merged geometrically, so adding them costs ``O(m log n)``.
Out of scope: deliberate encodings (compression, encryption, ciphers, spelled-out or shuffled
text, numbers in tensors other than byte arrays, short fragments below the 6-gram and 40-letter
thresholds) -- the guard stops accidental leaks and their casual disguises.

Error messages never repeat the protected text: they name only *where* it was found.
"""

from __future__ import annotations

import base64
import binascii
import functools
import html
import json
import os
import re
import unicodedata
import urllib.parse
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from mistill.errors import MistillInputError

PRIVACY_LEVELS: tuple[str, ...] = ("synthetic", "public", "restricted")
"""Corpus privacy levels; only ``"restricted"`` makes the guard refuse anything."""

NGRAM: int = 6
"""Word n-gram length shared between a candidate and a protected text that counts as a leak."""

CHAR_WINDOW: int = 40
"""Letters (separators removed) shared from a protected word start on that count as a leak."""

MIN_SHORT_CHARS: int = 16
"""Protected texts shorter than :data:`NGRAM` words are matched only if at least this long."""

FREE_TEXT_WORDS: int = 12
"""In a restricted corpus, a dataset cell with at least this many words is free text: refused."""

MAX_DECODE_ROUNDS: int = 4
"""Rounds of undoing JSON, HTML and URL escapes (a text encoded twice needs two)."""

TEXT_SUFFIXES: frozenset[str] = frozenset(
    {".json", ".jsonl", ".csv", ".tsv", ".md", ".txt", ".html", ".htm", ".tex", ".yaml", ".yml",
     ".log", ".svg", ".xml", ".jinja", ".py", ".toml", ".cfg", ".ini", ".rst"})
"""File types read as text and scanned (a model directory's ``merges.txt``, ``vocab.json``,
``tokenizer.json``, ``config.json`` and ``chat_template.jinja`` among them)."""

MARKUP_SUFFIXES: frozenset[str] = frozenset({".html", ".htm", ".xml", ".svg", ".md"})
"""Text types also scanned with their tags removed (words split by tags)."""

NUMPY_SUFFIXES: frozenset[str] = frozenset({".npy", ".npz"})
"""Numpy files: string arrays scanned, numeric arrays allowed, object arrays refused."""

PICKLE_SUFFIXES: frozenset[str] = frozenset({".pt", ".pth", ".bin"})
"""Torch pickles: loaded with ``weights_only=True``; strings scanned, tensors allowed."""

STRINGS_SUFFIXES: frozenset[str] = frozenset({".model"})
"""Binary files that store their strings plainly (sentencepiece protobuf): strings scanned."""

BINARY_SUFFIXES: frozenset[str] = (NUMPY_SUFFIXES | PICKLE_SUFFIXES | STRINGS_SUFFIXES
                                   | frozenset({".safetensors"}))
"""Binary file types the guard can read; any other binary file is refused for a restricted corpus."""

CONFUSABLES: dict[str, str] = {
    # Cyrillic capitals that render like Latin capitals
    "А": "A", "В": "B", "Е": "E", "К": "K", "М": "M", "Н": "H", "О": "O", "Р": "P", "С": "C",
    "Т": "T", "Х": "X", "У": "Y", "Ү": "Y", "Ѕ": "S", "І": "I", "Ј": "J", "Ӏ": "I", "Ԛ": "Q",
    "Ԝ": "W", "Ԍ": "G", "Ѵ": "V",
    # Cyrillic small letters that render like Latin small letters
    "а": "a", "в": "b", "е": "e", "к": "k", "м": "m", "н": "h", "о": "o", "р": "p", "с": "c",
    "т": "t", "х": "x", "у": "y", "ү": "y", "ѕ": "s", "і": "i", "ј": "j", "ӏ": "l", "һ": "h",
    "ԁ": "d", "ԛ": "q", "ԝ": "w", "ь": "b", "ѵ": "v",
    # Greek capitals
    "Α": "A", "Β": "B", "Ε": "E", "Ζ": "Z", "Η": "H", "Ι": "I", "Κ": "K", "Μ": "M", "Ν": "N",
    "Ο": "O", "Ρ": "P", "Τ": "T", "Υ": "Y", "Χ": "X", "Ϳ": "J",
    # Greek small letters
    "α": "a", "β": "b", "γ": "y", "ε": "e", "η": "n", "ι": "i", "κ": "k", "μ": "u", "ν": "v",
    "ο": "o", "ρ": "p", "υ": "u", "χ": "x", "ω": "w", "ϳ": "j",
    # Armenian small letters, and Latin letters that read as others
    "օ": "o", "ս": "u", "հ": "h", "ո": "n", "ı": "i", "ȷ": "j", "ɑ": "a", "ɡ": "g",
}
"""Lookalike letters folded to the Latin letter they render like (after NFKD, before case-folding).

Explicit and small on purpose: the Cyrillic and Greek letters (capital and small, mapped
separately, since e.g. Greek ``Η`` looks like ``H`` but ``η`` like ``n``) that pass for Latin
ones in common fonts, plus a few Armenian and Latin ones; all of them letters that NFKD leaves
as they are. Applied to protected texts and candidates alike, so a note written with Greek
letters (``β-blocker``) still matches itself.
"""

_BLANK_LETTERS = "\u115f\u1160\u3164\uffa0"  # Hangul fillers: letters that render as blanks

_WORD = re.compile(r"[^\W_]+")
_ESCAPE = re.compile(r"\\(?:u([dD][89abAB][0-9a-fA-F]{2})\\u([dD][c-fC-F][0-9a-fA-F]{2})"
                     r"|u([0-9a-fA-F]{4})|[nrtbf])")
_CONTROL = re.compile(r"[\x00-\x08\x0e-\x1b\x7f]")  # ASCII controls that are not whitespace
_PERCENT_RUN = re.compile(r"(?:%[0-9a-fA-F]{2})+")  # a run of URL escapes (UTF-8 bytes)
_CAMEL = re.compile(r"(?<=[a-z])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")  # theZebra, HTMLParser
_TAG = re.compile(r"<[^<>]*>")
# ICD-10-CM code shapes (A00, A00.1, T07.XXXD, QA0.0101) in case-folded text: public labels.
_CODE = re.compile(r"\b[a-z][0-9][0-9a-z](?:\.[0-9a-z]{1,4})?\b")

_MULT = np.uint64(1_000_003)
_CHAR_BASE = 0x9E3779B97F4A7C15  # odd, so it has an inverse modulo 2^64
_CHAR_BASE_INV = pow(_CHAR_BASE, -1, 1 << 64)
_WINDOW_CHUNK = 1 << 20  # candidate letters hashed per chunk (bounded memory)
_BATCH_CHARS = 1 << 22  # protected text characters indexed per batch (bounded memory)


class PrivacyError(MistillInputError):
    """Refused: a value bound for the tracking store contains protected (restricted) note text,
    or is a file the guard cannot read.

    ``where`` names the place ("param max_len", "tag mistill.arm", "metric name", an artifact
    path); the protected text itself is never repeated in the message. ``reason`` replaces the
    default "it contains protected note text" for files that cannot be scanned.
    """

    def __init__(self, where: str, *, file: str | None = None, reason: str | None = None) -> None:
        self.where = where
        self.reason = reason or "it contains protected note text"
        super().__init__(f"refusing to log {where}: {self.reason} "
                         f"(corpus privacy level 'restricted')", file=file)


# ------------------------------------------------------------------------------ normalisation
def _unescape(text: str) -> str:
    """Undo JSON-style escapes (``\\n``, ``\\u00e9``, surrogate pairs) so escaped text tokenises
    like the original."""
    if "\\" not in text:
        return text

    def one(m: re.Match) -> str:
        if m.group(1):
            hi, lo = int(m.group(1), 16), int(m.group(2), 16)
            return chr(0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00))
        return chr(int(m.group(3), 16)) if m.group(3) else " "

    return _ESCAPE.sub(one, text)


def decode_escapes(text: str) -> str:
    """Undo JSON, HTML and URL escapes, repeatedly (at most :data:`MAX_DECODE_ROUNDS` rounds)."""
    for _ in range(MAX_DECODE_ROUNDS):
        out = _unescape(text)
        if "&" in out:
            out = html.unescape(out)
        if "%" in out:  # each run of escapes decoded as urllib.parse.unquote decodes it, the rest
            # left alone (unquote itself walks every '%' in Python: slow on long texts)
            out = _PERCENT_RUN.sub(lambda m: urllib.parse.unquote(m.group()), out)
        if out == text:
            break
        text = out
    return text


@functools.lru_cache(maxsize=1)
def _char_classes() -> tuple[re.Pattern, re.Pattern, frozenset[int], frozenset[int]]:
    """The combining marks (Mn, Me) and the invisible characters (format, Cf, and control
    characters other than whitespace, Cc): regexes of those in the basic plane, and sets of
    those in planes 1 and 14 (a regex class with astral ranges is slow to match).

    Built once. Regex substitution with a fixed replacement runs in C, unlike
    ``str.translate`` on non-ASCII text.
    """
    marks: list[int] = []
    invisible: list[int] = []
    for cp in (*range(0x20000), *range(0xE0000, 0xE1000)):
        cat = unicodedata.category(chr(cp))
        if cat in ("Mn", "Me"):
            marks.append(cp)
        elif cat == "Cf" or (cat == "Cc" and not chr(cp).isspace()):
            invisible.append(cp)
    return (re.compile(_char_class([c for c in marks if c < 0x10000])),
            re.compile(_char_class([c for c in invisible if c < 0x10000])),
            frozenset(c for c in marks if c >= 0x10000), frozenset(c for c in invisible if c >= 0x10000))


def _replace_astral(text: str, chars: frozenset[int], repl: str) -> str:
    """``text`` with its astral characters that are in ``chars`` replaced by ``repl``."""
    return _ASTRAL.sub(lambda m: repl if ord(m.group()) in chars else m.group(), text)


def _char_class(cps: list[int]) -> str:
    """A regex character class of the sorted code points ``cps``, as ranges."""
    parts: list[str] = []
    i = 0
    while i < len(cps):
        j = i
        while j + 1 < len(cps) and cps[j + 1] == cps[j] + 1:
            j += 1
        parts.append(re.escape(chr(cps[i])) + ("-" + re.escape(chr(cps[j])) if j > i else ""))
        i = j + 1
    return "[" + "".join(parts) + "]"


_ASTRAL = re.compile("[\U00010000-\U0010ffff]")
_LOOKALIKE = re.compile("[" + re.escape("".join(CONFUSABLES) + _BLANK_LETTERS) + "]")
_LOOKALIKE_TABLE: dict[int, str] = {**{ord(k): v for k, v in CONFUSABLES.items()},
                                    **{ord(ch): " " for ch in _BLANK_LETTERS}}


def _folded_forms(text: str) -> list[str]:
    """Escapes undone, compatibility-folded, marks dropped, lookalikes folded (case kept, for
    camelCase splitting): one form, or two when ``text`` holds invisible characters.

    An invisible (format or control) character may hide inside a word (``t\\u200bhe``) or stand
    for a space between words (``the\\u200bzebra``): the first form drops them, the second (only
    when there are any) reads them as spaces.
    """
    text = decode_escapes(text)
    if text.isascii():
        if _CONTROL.search(text) is None:
            return [text]
        return [_CONTROL.sub("", text), _CONTROL.sub(" ", text)]
    marks, invisible, astral_marks, astral_invisible = _char_classes()
    text = marks.sub("", unicodedata.normalize("NFKD", text))
    astral = _ASTRAL.search(text) is not None
    if astral:
        text = _replace_astral(text, astral_marks, "")
    if _LOOKALIKE.search(text):
        text = text.translate(_LOOKALIKE_TABLE)
    if invisible.search(text) is None and not (
            astral and any(ord(m.group()) in astral_invisible for m in _ASTRAL.finditer(text))):
        return [text]
    forms = [invisible.sub(repl, text) for repl in ("", " ")]
    if astral:
        forms = [_replace_astral(f, astral_invisible, repl) for f, repl in zip(forms, ("", " "))]
    return forms


def _cased(folded: str, *, camel: bool = True) -> str:
    """A folded form camelCase-split (``camel``) and case-folded."""
    return (_CAMEL.sub(" ", folded) if camel else folded).casefold()


def normalise(text: str, *, camel: bool = True) -> str:
    """The form every text is matched in (see the module docstring), invisible characters
    dropped: case-folded, separators kept (tokenisation drops them). ``camel=False`` leaves
    camelCase words whole."""
    return _cased(_folded_forms(text)[0], camel=camel)


def _segments_of(normalised: str) -> list[list[str]]:
    """Word runs of a normalised text, split at label codes (codes dropped)."""
    return [words for part in _CODE.split(normalised) if (words := _WORD.findall(part))]


def segments(text: str) -> list[list[str]]:
    """Normalised word tokens of ``text`` in runs separated by label codes.

    Codes are public: an n-gram never spans one, so a list of gold codes, or a description
    followed by its code, is never mistaken for a note's text.
    """
    return _segments_of(normalise(text))


def tokens(text: str) -> list[str]:
    """Normalised word tokens of ``text`` (escapes undone, disguises folded, codes dropped)."""
    return [w for seg in segments(text) for w in seg]


# --------------------------------------------------------------------------------- hashing
def _word_hashes(words: list[str]) -> np.ndarray:
    """``uint64[len(words)]``: Python's string hash of each word (stable within one process)."""
    return np.fromiter(map(hash, words), dtype=np.int64, count=len(words)).view(np.uint64)


def _poly(h: np.ndarray, n: int) -> np.ndarray:
    """``uint64[len(h) - n + 1]``: ``sum_k h[i+k] * M^(n-1-k)`` modulo 2^64 for every ``i``."""
    m = h.size - n + 1
    if m <= 0:
        return np.zeros(0, dtype=np.uint64)
    out = h[:m].copy()
    with np.errstate(over="ignore"):
        for k in range(1, n):
            out = out * _MULT + h[k:k + m]
    return out


def ngram_hashes(words: list[str], n: int = NGRAM) -> np.ndarray:
    """Hashes of the word ``n``-grams of ``words``: ``uint64[len(words) - n + 1]`` (empty if short).

    Each word is hashed once (Python's string hash, stable within one process); an n-gram's hash
    is the polynomial ``sum_k h(w_{i+k}) * M^(n-1-k)`` modulo 2^64.
    """
    return _poly(_word_hashes(words), n)


def segment_hashes(text: str, n: int = NGRAM) -> np.ndarray:
    """The word n-gram hashes of every code-free run of ``text``."""
    return _Stream.of(segments(text)).ngrams(n)


def _mix(codes: np.ndarray) -> np.ndarray:
    """``uint64[L]``: a splitmix64 finaliser of each code point (spreads small integers)."""
    with np.errstate(over="ignore"):
        z = codes.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _powers(base: int, n: int) -> np.ndarray:
    """``uint64[n]``: ``base^0 .. base^(n-1)`` modulo 2^64."""
    out = np.full(n, base, dtype=np.uint64)
    if n:
        out[0] = 1
        with np.errstate(over="ignore"):
            np.cumprod(out, out=out)
    return out


def window_hashes(codes: np.ndarray, w: int = CHAR_WINDOW,
                  starts: np.ndarray | None = None) -> np.ndarray:
    """Hashes of the ``w``-character windows of ``codes`` (``uint32[L]`` code points).

    Returns ``uint64[len(starts)]`` (``starts``: window start offsets, each ``<= L - w``), or
    ``uint64[L - w + 1]`` for every start when ``starts`` is None. A window's hash is
    ``sum_k x[i+k] * B^k`` modulo 2^64 over the mixed codes ``x``, read off one prefix sum as
    ``(P[i+w] - P[i]) * B^-i`` (``B`` odd, so invertible): linear in ``L`` whatever ``w``.
    """
    n = codes.size
    if n < w:
        return np.zeros(0, dtype=np.uint64)
    with np.errstate(over="ignore"):
        prefix = np.zeros(n + 1, dtype=np.uint64)
        np.cumsum(_mix(codes) * _powers(_CHAR_BASE, n), out=prefix[1:])
        if starts is None:
            return (prefix[w:] - prefix[:n - w + 1]) * _powers(_CHAR_BASE_INV, n - w + 1)
        inv = _powers(_CHAR_BASE_INV, int(starts.max()) + 1 if starts.size else 0)
        return (prefix[starts + w] - prefix[starts]) * inv[starts]


class _Stream(NamedTuple):
    """Words of one or more texts with the runs they belong to.

    ``words``: the tokens in order; ``seg_end``: ``int64[len(words)]``, for each word the index
    one past the last word of its run (a run: a code-free segment of one text).
    """

    words: list[str]
    seg_end: np.ndarray

    @staticmethod
    def of(runs: Iterable[list[str]]) -> _Stream:
        words: list[str] = []
        ends: list[int] = []
        sizes: list[int] = []
        for run in runs:
            words.extend(run)
            ends.append(len(words))
            sizes.append(len(run))
        seg_end = np.repeat(np.asarray(ends, dtype=np.int64), np.asarray(sizes, dtype=np.int64))
        return _Stream(words, seg_end)

    def ngrams(self, n: int = NGRAM, *, h: np.ndarray | None = None,
               skip_numeric: bool = False) -> np.ndarray:
        """``uint64[k]``: hashes of the word n-grams inside one run (``h``: the word hashes)."""
        if len(self.words) < n:
            return np.zeros(0, dtype=np.uint64)
        out = _poly(_word_hashes(self.words) if h is None else h, n)
        keep = np.arange(out.size) + n <= self.seg_end[:out.size]
        if skip_numeric:
            digit = np.fromiter(map(str.isdigit, self.words), dtype=np.int64, count=len(self.words))
            c = np.concatenate(([0], np.cumsum(digit)))
            keep &= (c[n:] - c[:-n]) < n
        return out[keep]

    def letters(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The letter stream: ``(codes uint32[L], word_start int64[len(words)],
        run_end int64[len(words)])``, offsets into ``codes`` (the words concatenated)."""
        codes = np.frombuffer("".join(self.words).encode("utf-32-le"), dtype=np.uint32)
        lengths = np.fromiter(map(len, self.words), dtype=np.int64, count=len(self.words))
        offsets = np.zeros(len(self.words) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return codes, offsets[:-1], offsets[self.seg_end]


def _protected_windows(stream: _Stream, w: int = CHAR_WINDOW) -> np.ndarray:
    """Hashes of the ``w``-letter windows that start at a word start and stay inside its run,
    made not only of digits."""
    if not stream.words:
        return np.zeros(0, dtype=np.uint64)
    codes, start, run_end = stream.letters()
    start = start[start + w <= run_end]
    if not start.size:
        return np.zeros(0, dtype=np.uint64)
    digit = ((codes >= 48) & (codes <= 57)).astype(np.int64)
    c = np.concatenate(([0], np.cumsum(digit)))
    start = start[c[start + w] - c[start] < w]
    return window_hashes(codes, w, start)


def _all_windows(stream: _Stream, w: int = CHAR_WINDOW) -> Iterator[np.ndarray]:
    """Hashes of every ``w``-letter window inside a run, in chunks (bounded memory)."""
    if not stream.words:
        return
    codes, start, run_end = stream.letters()
    lengths = np.diff(np.append(start, codes.size))
    for a in range(0, codes.size - w + 1, _WINDOW_CHUNK):
        hashes = window_hashes(codes[a:a + _WINDOW_CHUNK + w - 1], w)
        # the run end of every letter from a on: each word's run end repeated over its letters
        first = int(np.searchsorted(start, a, side="right")) - 1
        last = int(np.searchsorted(start, a + hashes.size, side="left"))
        ends = np.repeat(run_end[first:last], lengths[first:last])[a - start[first]:][:hashes.size]
        yield hashes[np.arange(a + w, a + w + hashes.size) <= ends]


def _sorted_unique(hashes: np.ndarray) -> np.ndarray:
    """``hashes`` sorted, duplicates removed (a sort: faster than ``np.unique`` on ``uint64``)."""
    out = np.sort(hashes)
    if out.size > 1:
        out = out[np.concatenate(([True], out[1:] != out[:-1]))]
    return out


def _member(sorted_hashes: np.ndarray, query: np.ndarray) -> np.ndarray:
    """``bool[len(query)]``: which of ``query`` are in the sorted array ``sorted_hashes``."""
    if not sorted_hashes.size or not query.size:
        return np.zeros(query.size, dtype=bool)
    idx = np.searchsorted(sorted_hashes, query)
    idx[idx == sorted_hashes.size] = 0
    return sorted_hashes[idx] == query


class _HashSet:
    """A growing set of ``uint64`` hashes kept as disjoint sorted runs, merged geometrically.

    Adding ``m`` hashes to ``n`` costs ``O(m log n)`` amortised (a trace added after every
    generation does not re-sort the whole index); a lookup searches ``O(log n)`` runs.
    """

    def __init__(self) -> None:
        self._runs: list[np.ndarray] = []

    def __len__(self) -> int:
        return sum(int(r.size) for r in self._runs)

    def add(self, hashes: np.ndarray, exclude: np.ndarray | None = None) -> None:
        """Add ``hashes`` except those in the sorted array ``exclude``."""
        new = _sorted_unique(hashes)
        if exclude is not None and exclude.size:
            new = new[~_member(exclude, new)]
        for run in self._runs:
            new = new[~_member(run, new)]
        if not new.size:
            return
        self._runs.append(new)
        while len(self._runs) > 1 and self._runs[-2].size <= 2 * self._runs[-1].size:
            b, a = self._runs.pop(), self._runs.pop()
            merged = np.concatenate([a, b])
            merged.sort(kind="stable")  # two sorted runs: a linear merge
            self._runs.append(merged)

    def any_in(self, query: np.ndarray) -> bool:
        """True iff one of ``query`` is in the set."""
        return any(bool(_member(run, query).any()) for run in self._runs)


# ------------------------------------------------------------------------------------ guard
class PrivacyGuard:
    """Refuse strings, mappings and files that contain protected text, for restricted corpora.

    Args:
        protected_texts: the note texts and trace texts of the corpus (more can be added later
            with :meth:`protect`).
        level: the corpus privacy level, one of :data:`PRIVACY_LEVELS`.
        public_texts: texts known to be public (label descriptions); their 6-grams and letter
            windows never count.

    For ``"synthetic"`` and ``"public"`` corpora nothing is indexed and every check passes;
    :attr:`allows_text` tells a stage whether it may log texts at all.
    """

    def __init__(self, protected_texts: Iterable[str], level: str, *,
                 public_texts: Iterable[str] = ()) -> None:
        if level not in PRIVACY_LEVELS:
            raise MistillInputError(f"unknown privacy level {level!r}; use one of {PRIVACY_LEVELS}",
                                    field="privacy")
        self.level = level
        self._ngrams = _HashSet()
        self._windows = _HashSet()
        self._short: dict[int, _HashSet] = {}
        self._public_ngrams = np.zeros(0, dtype=np.uint64)
        self._public_windows = np.zeros(0, dtype=np.uint64)
        if not self.allows_text:
            self._index_public(public_texts)
            self.protect(protected_texts)

    @property
    def allows_text(self) -> bool:
        """True iff the corpus is synthetic or public (texts may be logged)."""
        return self.level != "restricted"

    @property
    def n_protected_ngrams(self) -> int:
        """Number of distinct protected 6-gram hashes indexed."""
        return len(self._ngrams)

    @property
    def n_protected_windows(self) -> int:
        """Number of distinct protected letter-window hashes indexed."""
        return len(self._windows)

    def _index_public(self, texts: Iterable[str]) -> None:
        runs: list[list[str]] = []
        for text in texts:
            folded = _folded_forms(text)[0]
            runs += _segments_of(_cased(folded))
            runs += _segments_of(_cased(folded, camel=False))
        stream = _Stream.of(runs)
        self._public_ngrams = _sorted_unique(stream.ngrams())
        self._public_windows = _sorted_unique(np.concatenate([np.zeros(0, np.uint64),
                                                              *_all_windows(stream)]))

    def protect(self, texts: Iterable[str]) -> None:
        """Add protected texts (e.g. traces generated during a stage). No-op unless restricted."""
        if self.allows_text:
            return
        batch: list[str] = []
        size = 0
        for text in texts:
            batch.append(text)
            size += len(text)
            if size >= _BATCH_CHARS:
                self._protect_batch(batch)
                batch, size = [], 0
        if batch:
            self._protect_batch(batch)

    def _protect_batch(self, texts: list[str]) -> None:
        """Index one batch of protected texts: 6-grams of both camelCase forms, letter windows,
        short texts."""
        split_runs: list[list[str]] = []
        plain_runs: list[list[str]] = []
        for text in texts:
            folded = _folded_forms(text)[0]
            split, plain = _cased(folded), _cased(folded, camel=False)
            forms = [_segments_of(split)]
            if plain != split:  # camelCase inside the text: index it unsplit as well
                forms.append(_segments_of(plain))
                plain_runs += forms[1]
            split_runs += forms[0]
            for runs in forms:
                words = [w for run in runs for w in run]
                if 0 < len(words) < NGRAM and len(" ".join(words)) >= MIN_SHORT_CHARS:
                    self._short.setdefault(len(words), _HashSet()).add(ngram_hashes(words, len(words)))
        split_stream = _Stream.of(split_runs)
        grams = [split_stream.ngrams(skip_numeric=True),
                 _Stream.of(plain_runs).ngrams(skip_numeric=True)]
        self._ngrams.add(np.concatenate(grams), exclude=self._public_ngrams)
        self._windows.add(_protected_windows(split_stream), exclude=self._public_windows)

    # ----------------------------------------------------------------------------------- checks
    def contains_protected(self, text: str, *, _depth: int = 0) -> bool:
        """True iff ``text`` shares a 6-gram or a 40-letter window with a protected text, or
        contains a short one (after normalising both: see the module docstring), read as it is
        and under its casual disguises (reversed, doubled words, leetspeak, base64)."""
        if self.allows_text or not text:
            return False
        for candidate in _disguises(text):
            for form in _folded_forms(candidate):
                runs = _segments_of(_cased(form))
                if self._stream_protected(_Stream.of(runs)):
                    return True
                undoubled = _undoubled(runs)
                if undoubled is not None and self._stream_protected(_Stream.of(undoubled)):
                    return True
        if _depth < MAX_BASE64_DEPTH:
            return any(self.contains_protected(decoded, _depth=_depth + 1)
                       for decoded in _base64_texts(text))
        return False

    def _stream_protected(self, stream: _Stream) -> bool:
        """True iff one candidate token stream shares a 6-gram, a window or a short text."""
        if not stream.words:
            return False
        h = _word_hashes(stream.words)
        if len(self._ngrams) and self._ngrams.any_in(stream.ngrams(h=h)):
            return True
        for n, short in self._short.items():
            if short.any_in(_poly(h, n)):  # across codes too: a short text is a whole sequence
                return True
        if len(self._windows):
            return any(self._windows.any_in(chunk) for chunk in _all_windows(stream))
        return False

    def check_text(self, text: str, where: str) -> None:
        """Raise :class:`PrivacyError` naming ``where`` if ``text`` contains protected text."""
        if self.contains_protected(text):
            raise PrivacyError(where)

    def check_mapping(self, d: Mapping[str, Any], where: str) -> None:
        """Check every key and value of ``d`` (nested mappings and lists too).

        ``where`` is the kind of entry ("param", "tag", "metric"): a refused key is reported as
        "<where> name" (the key itself is not repeated), a refused value as "<where> <key>".
        """
        if self.allows_text:
            return
        for key, value in d.items():
            self.check_text(str(key), f"{where} name")
            self._check_value(value, f"{where} {key}")

    def _check_value(self, value: Any, where: str) -> None:
        if value is None or isinstance(value, (bool, int, float, np.number)):
            return
        if isinstance(value, Mapping):
            for k, v in value.items():
                self.check_text(str(k), f"{where} (a key)")
                self._check_value(v, f"{where}.{k}")
            return
        if isinstance(value, (list, tuple, set, frozenset)):
            items = list(value)
            for item in items:
                self._check_value(item, where)
            strings = [s for s in items if isinstance(s, str)]
            if len(strings) > 1:  # text split over list items (word lists, token lists)
                self._check_joined(strings, where)
            return
        self.check_text(str(value), where)

    def _check_joined(self, strings: list[str], where: str, file: str | None = None) -> None:
        """Refuse ``strings`` joined by spaces (word lists) or by nothing (token pieces)."""
        if self.contains_protected(" ".join(strings)) or self.contains_protected("".join(strings)):
            raise PrivacyError(where, file=file)

    # ------------------------------------------------------------------------------------ files
    def check_file(self, path: str | os.PathLike) -> None:
        """Check one file bound for the artifact store (see the module docstring for the types).

        Raises :class:`PrivacyError` naming the file when it carries protected text, or when it
        is a binary type the guard cannot read (with the readable types listed).
        """
        if self.allows_text:
            return
        p = Path(path)
        where = f"artifact {p.name}"
        suffix = p.suffix.lower()
        if suffix in NUMPY_SUFFIXES:
            self._check_numpy(p, where)
            return
        if suffix in PICKLE_SUFFIXES:
            self._check_strings(_pickle_strings(p, where), where, p)
            return
        if suffix == ".safetensors":
            self._check_text_file(_safetensors_header(p, where), where, p, ".json")
            return
        raw = p.read_bytes()
        if suffix in STRINGS_SUFFIXES:  # protobuf: strings stored plainly between binary fields
            if self.contains_protected(raw.decode("utf-8", errors="replace")):
                raise PrivacyError(where, file=str(p))
            return
        text = _as_text(raw, strict=suffix not in TEXT_SUFFIXES)
        if text is None:
            raise PrivacyError(where, file=str(p), reason=_unreadable(suffix, suffix in TEXT_SUFFIXES))
        self._check_text_file(text, where, p, suffix)

    def _check_text_file(self, text: str, where: str, p: Path, suffix: str) -> None:
        if self.contains_protected(text):
            raise PrivacyError(where, file=str(p))
        if suffix in MARKUP_SUFFIXES and "<" in text and self.contains_protected(_TAG.sub(" ", text)):
            raise PrivacyError(where, file=str(p))
        if suffix in (".json", ".jsonl"):
            strings = list(_json_strings(text, jsonl=suffix == ".jsonl"))
            if len(strings) > 1:
                self._check_joined(strings, where, str(p))

    def _check_strings(self, strings: list[str], where: str, p: Path) -> None:
        if len(strings) == 1 and self.contains_protected(strings[0]):
            raise PrivacyError(where, file=str(p))
        if len(strings) > 1:
            self._check_joined(strings, where, str(p))

    def _check_numpy(self, p: Path, where: str) -> None:
        object_array = PrivacyError(f"{where} (numpy object array)", file=str(p),
                                    reason="numpy object arrays can hold anything and are not read")
        try:
            loaded = np.load(p, allow_pickle=False, mmap_mode="r" if p.suffix.lower() == ".npy" else None)
            if isinstance(loaded, np.ndarray):
                arrays = [loaded]
            else:
                with loaded:
                    arrays = [loaded[k] for k in loaded.files]
        except ValueError:  # object arrays need pickle: they can hold anything
            raise object_array from None
        except (OSError, EOFError, zipfile.BadZipFile) as exc:
            raise PrivacyError(where, file=str(p), reason=f"it is not a readable numpy file ({exc})") from None
        strings: list[str] = []
        for arr in arrays:
            fields = [arr[name] for name in arr.dtype.names] if arr.dtype.names else [arr]
            for a in fields:
                if a.dtype.kind == "O":
                    raise object_array
                if a.dtype.kind in "US":
                    strings += [x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x)
                                for x in np.asarray(a).ravel().tolist()]
                elif a.dtype.kind in "ui" and a.dtype.itemsize == 1 and a.size:  # raw UTF-8 bytes
                    strings.append(np.ascontiguousarray(a).astype(np.uint8).tobytes()
                                   .decode("utf-8", "replace"))
        self._check_strings(strings, where, p)

    def check_dir(self, path: str | os.PathLike) -> None:
        """Check every file under ``path`` (recursively) with :meth:`check_file`."""
        if self.allows_text:
            return
        for root, dirs, files in os.walk(path):
            dirs.sort()
            for name in sorted(files):
                self.check_file(Path(root) / name)

    def check_dataframe(self, df: Any, where: str) -> None:
        """Check a pandas DataFrame: column names, and string cells of every column.

        Restricted corpora: a text column is refused if any cell contains protected text or is
        free text (at least :data:`FREE_TEXT_WORDS` words); identifiers and short labels pass.
        """
        if self.allows_text:
            return
        for col in df.columns:
            self.check_text(str(col), f"{where} column name")
            series = df[col]
            if series.dtype.kind in "biufcmM":
                continue
            cells = [v for v in series.tolist() if isinstance(v, str)]
            for cell in cells:
                if len(tokens(cell)) >= FREE_TEXT_WORDS:  # label codes are not words here
                    raise PrivacyError(f"{where} column {col!r} (free-text column)")
            if cells:
                self.check_text("\n".join(cells), f"{where} column {col!r}")


# ------------------------------------------------------------------------------ file readers
def _unreadable(suffix: str, text_type: bool) -> str:
    """The reason given for refusing a binary file the guard cannot read."""
    kind = f"'{suffix}'" if suffix else "without a suffix"
    what = (f"a {kind} file holding binary data (NUL bytes, no byte-order mark)" if text_type else
            f"a binary file of a type the privacy guard cannot read ({kind})")
    readable = " ".join(sorted(TEXT_SUFFIXES | BINARY_SUFFIXES))
    return (f"it is {what}, so it may hold protected note text that cannot be checked; for a "
            f"restricted corpus only UTF-8 text files and these types are logged: {readable}")


def _as_text(raw: bytes, *, strict: bool) -> str | None:
    """``raw`` decoded as text (UTF-8, or UTF-16/32 with a byte-order mark); None if binary.

    ``strict``: bytes that are not UTF-8 make it binary (else they read as replacement
    characters). NUL bytes without a byte-order mark make it binary either way.
    """
    for bom, codec in ((b"\xff\xfe\x00\x00", "utf-32"), (b"\x00\x00\xfe\xff", "utf-32"),
                       (b"\xff\xfe", "utf-16"), (b"\xfe\xff", "utf-16")):
        if raw.startswith(bom):
            return raw.decode(codec, errors="replace")
    if b"\x00" in raw:
        return None
    try:
        return raw.decode("utf-8", errors="strict" if strict else "replace")
    except UnicodeDecodeError:
        return None


def _safetensors_header(p: Path, where: str) -> str:
    """The JSON header of a safetensors file (tensor names, dtypes, shapes, ``__metadata__``)."""
    bad = PrivacyError(where, file=str(p), reason="it is not a readable safetensors file")
    with open(p, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise bad
        n = int.from_bytes(head, "little")
        if n > min(p.stat().st_size - 8, 1 << 28):
            raise bad
        raw = fh.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise bad from None
    if not isinstance(header, dict):
        raise bad
    return json.dumps(header, ensure_ascii=False)


def _pickle_strings(p: Path, where: str) -> list[str]:
    """Every string in a torch pickle, in order, read with ``torch.load(weights_only=True)``
    (an allow-list unpickler: no code runs); tensors are skipped.

    A file that loader refuses (other objects than tensors and plain containers) is refused.
    """
    import torch  # deferred: torch is slow to import

    try:
        obj = torch.load(p, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(p))
    except Exception as exc:  # noqa: BLE001 -- any failure to read it safely means: refuse
        reason = (f"it cannot be read by torch.load(weights_only=True) ({type(exc).__name__}), so its "
                  f"text cannot be checked; save only tensors, numbers and strings in plain "
                  f"containers, or keep it local")
        raise PrivacyError(where, file=str(p), reason=reason) from None
    return list(_object_strings(obj))


def _object_strings(obj: Any) -> Iterator[str]:
    """Strings (and UTF-8 bytes) of a loaded object: dict keys and values, list, tuple and set
    items, depth first in order; tensors and numbers skipped."""
    stack: list[Any] = [obj]
    seen: set[int] = set()
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, (bytes, bytearray)):
            yield bytes(item).decode("utf-8", errors="replace")
        elif isinstance(item, (Mapping, list, tuple, set, frozenset)):
            if id(item) in seen:
                continue
            seen.add(id(item))
            if isinstance(item, Mapping):
                for k, v in reversed(list(item.items())):
                    stack.append(v)
                    stack.append(k)
            elif isinstance(item, (set, frozenset)):
                stack.extend(sorted(item, key=repr, reverse=True))
            elif (raw := _byte_list(item)) is not None:
                yield raw
            else:
                stack.extend(reversed(item))


def _json_strings(text: str, *, jsonl: bool) -> Iterator[str]:
    """Every string (keys and values) of a JSON or JSONL document, in document order."""
    docs: list[Any] = []
    try:
        if jsonl:
            docs = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            docs = [json.loads(text)]
    except json.JSONDecodeError:
        return
    stack: list[Any] = list(reversed(docs))
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            for k, v in reversed(list(item.items())):
                stack.append(v)
                stack.append(k)
        elif isinstance(item, list):
            raw = _byte_list(item)
            if raw is not None:
                yield raw
            else:
                stack.extend(reversed(item))


MIN_BYTE_LIST = 16
"""A list of at least this many integers, all in 0..255, is read as UTF-8 bytes too."""


def _byte_list(items: Any) -> str | None:
    """A list or tuple of integers in 0..255 (at least :data:`MIN_BYTE_LIST`), as UTF-8 text."""
    if not isinstance(items, (list, tuple)) or len(items) < MIN_BYTE_LIST:
        return None
    if not all(type(x) is int and 0 <= x <= 255 for x in items):
        return None
    return bytes(items).decode("utf-8", errors="replace")


MAX_BASE64_DEPTH = 2
"""base64 inside base64 is decoded this many times."""
_BASE64 = re.compile(r"(?:[A-Za-z0-9+/]{4}){8,}(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?"
                     r"|(?:[A-Za-z0-9_-]{4}){8,}(?:[A-Za-z0-9_-]{2}(?:==)?|[A-Za-z0-9_-]{3}=?)?")
_HEX = re.compile(r"[0-9a-fA-F_-]+")
_LONG_HEX = re.compile(r"\b[0-9a-fA-F-]{16,}\b")
_LEET_HINT = re.compile(r"[A-Za-z][0-9@$!|]+[A-Za-z]")
_REVERSED_HINT = re.compile(r"\b(?:eht|dna|htiw|saw|fo|erew|sah)\b", re.IGNORECASE)
ALWAYS_DISGUISED_CHARS = 1 << 16
"""Texts up to this size are also read reversed and with leetspeak undone, always; a larger one
only when it shows signs of them (a reversed common word; a digit or symbol between letters), so
that scanning large artifacts stays about as fast as one pass."""
_LEET = str.maketrans({"0": "o", "1": "i", "3": "e", "4": "a", "5": "s", "7": "t", "@": "a",
                       "$": "s", "!": "i", "|": "l"})


def _disguises(text: str) -> list[str]:
    """``text``, reversed, and with leetspeak undone (see :data:`ALWAYS_DISGUISED_CHARS`)."""
    small = len(text) <= ALWAYS_DISGUISED_CHARS
    forms = [text]
    if small or _REVERSED_HINT.search(text):
        forms.append(text[::-1])
    if _LEET_HINT.search(_LONG_HEX.sub(" ", text)):  # digests and ids are not leetspeak
        forms.append(text.translate(_LEET))
    return forms


def _undoubled(runs: list[list[str]]) -> list[list[str]] | None:
    """The word runs with each word repeated right after itself dropped; None when fewer than
    three words, or under a tenth of a large text's words, are doubled."""
    doubled = sum(a == b for run in runs for a, b in zip(run, run[1:]))
    n_words = sum(len(run) for run in runs)
    if doubled < 3 or (n_words > ALWAYS_DISGUISED_CHARS // 8 and doubled < n_words // 10):
        return None
    return [[w for i, w in enumerate(run) if i == 0 or run[i - 1] != w] for run in runs]


def _base64_texts(text: str) -> Iterator[str]:
    """The UTF-8 text of every base64 run of ``text`` (standard or URL-safe alphabet)."""
    for m in _BASE64.finditer(text):
        blob = m.group()
        if _HEX.fullmatch(blob):  # a digest or an id: hex, not text in base64
            continue
        try:
            raw = base64.b64decode(blob + "=" * (-len(blob) % 4),
                                   altchars=b"-_" if ("-" in blob or "_" in blob) else None)
        except (binascii.Error, ValueError):
            continue
        decoded = raw.decode("utf-8", errors="replace")
        if decoded.count("\ufffd") * 4 > len(decoded):  # mostly not UTF-8: bytes, not text
            continue
        yield decoded
