"""Parse a generation into its answer: validity, the last JSON list after ``</think>``, the guard.

The rules are the paper's "Validity and parsing" (App. C) and "Scoring an answer" (App. K):

- A generation is *valid* when its reasoning block is closed (``</think>``) and the token cap
  was not reached. A generation without any think tag (a chat template without thinking) is
  closed reasoning of length 0. An invalid generation scores as an empty answer, and codes are
  never scraped from the reasoning, closed or not.
- The answer is the last JSON list after the closing ``</think>`` (the list whose closing
  bracket comes last; an outer list wins over a list nested in it). Code fences around it are
  ignored because only the bracketed span is decoded. Its entries are restricted to inventory
  codes (matched through ``normalize`` when given, returned in the inventory's spelling) and
  de-duplicated in emission order.
- The degenerate guard flags an answer of at least 10 codes whose adjacent pairs are ascending
  in more than 90% of cases, an answer of more than 50 codes, or a generation that reached the
  cap. It counts the scored codes (inventory-restricted, de-duplicated). Degenerate answers are
  still scored; the flag is reported beside them.

``valid`` follows the brief's rule (closed and not capped). A valid generation whose answer
part holds no JSON list has ``valid=True, parsed=False`` and an empty answer; Table 46's
"valid: share of generations with a parsed final answer" is the share with ``parsed``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from mistill.errors import MistillInputError

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

# Degenerate guard (App. C): >= MIN codes with > SHARE of adjacent pairs ascending, or > MAX codes.
DEGENERATE_MIN_SORTED = 10
DEGENERATE_SORTED_SHARE = 0.9
DEGENERATE_MAX_CODES = 50

_DECODER = json.JSONDecoder()


def undotted(code: str) -> str:
    """Normal form for matching ICD-10-CM codes written dotted or undotted: ``"n18.9" -> "N189"``."""
    return code.strip().replace(".", "").upper()


class CodeIndex:
    """The inventory as a lookup from normalised spelling to the inventory's own spelling.

    Build it once per inventory and pass it to :func:`parse_answer` in place of the code list
    when parsing many generations (building the map for a 70k-code inventory per note is waste).
    ``aliases``: other spellings of inventory codes (a label space's ids beside its labels,
    ``{spelling: code}``), looked up after the codes themselves; an alias of a code outside the
    inventory is ignored. ``numbers``: an integer entry is read as its decimal spelling (ids
    written as JSON numbers); else it is a malformed entry.
    """

    def __init__(self, inventory_codes: Collection[str],
                 normalize: Callable[[str], str] | None = None,
                 aliases: Mapping[str, str] | None = None, *, numbers: bool = False) -> None:
        self.normalize = normalize
        self.numbers = numbers
        self._canonical: dict[str, str] = {}
        for code in inventory_codes:
            self._canonical.setdefault(self._key(code), code)
        known = set(self._canonical.values())
        self._aliases = {self._key(spelling): code for spelling, code in (aliases or {}).items() if code in known}

    def _key(self, code: str) -> str:
        code = code.strip()
        return self.normalize(code) if self.normalize is not None else code

    def lookup(self, code: str) -> str | None:
        """The inventory's spelling of ``code``, or None when it is not an inventory code."""
        key = self._key(code)
        found = self._canonical.get(key)
        return found if found is not None else self._aliases.get(key)

    def __len__(self) -> int:
        return len(self._canonical)


@dataclass(frozen=True)
class Answer:
    """A parsed generation.

    ``codes``: the scored answer, inventory spelling, emission order, de-duplicated (empty when
    invalid). ``reason``: ``"ok"``, ``"capped"``, ``"unclosed_think"``, ``"no_json_list"`` (no
    bracketed span after ``</think>`` decodes as JSON) or ``"not_a_list"`` (the answer part is
    JSON but holds no list). ``n_raw``: entries of the decoded list; ``n_out_of_inventory``:
    string entries that are not inventory codes (duplicates counted); ``n_malformed``:
    non-string entries (integers read as ids where the index takes ``numbers`` are not).
    ``degenerate_reason``: ``""``, ``"cap"``, ``"too_many_codes"`` or ``"ascending"`` (the first
    that applies, in that order).
    """

    codes: tuple[str, ...]
    valid: bool
    parsed: bool
    reason: str
    n_raw: int
    n_out_of_inventory: int
    n_malformed: int
    degenerate: bool
    degenerate_reason: str


def split_reasoning(generation: str) -> tuple[str, str]:
    """Split a generation into (text inside the reasoning block, answer part after it).

    The reasoning block runs from the first ``<think>`` (or the start, when the chat template
    put ``<think>`` in the prompt) to the last ``</think>``. Without any think tag the
    reasoning is empty and the whole generation is the answer part. With ``<think>`` and no
    ``</think>`` (unclosed) everything after ``<think>`` is reasoning and the answer part is
    empty. Text is returned unstripped.
    """
    close = generation.rfind(THINK_CLOSE)
    open_ = generation.find(THINK_OPEN)
    if close < 0:
        if open_ < 0:
            return "", generation
        return generation[open_ + len(THINK_OPEN):], ""
    start = open_ + len(THINK_OPEN) if 0 <= open_ < close else 0
    return generation[start:close], generation[close + len(THINK_CLOSE):]


def reasoning_closed(generation: str) -> bool:
    """True when the reasoning block is closed, or when the generation has no think tag at all."""
    close = generation.rfind(THINK_CLOSE)
    if close < 0:
        return THINK_OPEN not in generation
    return THINK_OPEN not in generation[close:]  # a block reopened after the last close is open


def last_json_list(text: str) -> list | None:
    """The last JSON list in ``text``: the decodable ``[...]`` span whose end comes last.

    Every ``[`` is tried as the start of a JSON value; among the spans that decode to a list,
    the one ending last wins and, on a tie, the one starting first (the outer list).
    """
    best: tuple[int, int, list] | None = None  # (end, -start, value)
    start = text.rfind("[")
    while start >= 0:
        try:
            value, end = _DECODER.raw_decode(text, start)
        except json.JSONDecodeError:
            value, end = None, -1
        if isinstance(value, list) and (best is None or (end, -start) >= best[:2]):
            best = (end, -start, value)
        start = text.rfind("[", 0, start)
    return None if best is None else best[2]


def _strip_fences(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if not ln.strip().startswith("```")]
    return "\n".join(lines).strip()


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except (json.JSONDecodeError, ValueError):
        return False
    return bool(text)


def ascending_share(codes: tuple[str, ...]) -> float:
    """Share of adjacent pairs ``(c_i, c_{i+1})`` with ``c_i < c_{i+1}`` in undotted code order."""
    if len(codes) < 2:
        return 0.0
    keys = [undotted(c) for c in codes]
    return sum(a < b for a, b in zip(keys, keys[1:])) / (len(keys) - 1)


def degenerate_reason(codes: tuple[str, ...], capped: bool) -> str:
    """The degenerate guard: ``"cap"``, ``"too_many_codes"``, ``"ascending"`` or ``""``."""
    if capped:
        return "cap"
    if len(codes) > DEGENERATE_MAX_CODES:
        return "too_many_codes"
    if len(codes) >= DEGENERATE_MIN_SORTED and ascending_share(codes) > DEGENERATE_SORTED_SHARE:
        return "ascending"
    return ""


def parse_answer(generation: str, inventory_codes: Collection[str] | CodeIndex, *,
                 capped: bool = False,
                 normalize: Callable[[str], str] | None = None) -> Answer:
    """Parse one generation into its scored answer (see the module docstring for the rules).

    ``capped``: the generation reached the token cap (known to the generator, not the text).
    ``inventory_codes``: the label universe, or a prebuilt :class:`CodeIndex` (whose own
    ``normalize`` is then used and the argument here must be None).
    """
    if isinstance(inventory_codes, CodeIndex):
        if normalize is not None and normalize is not inventory_codes.normalize:
            raise MistillInputError("pass normalize to CodeIndex, not to parse_answer, with a "
                                    "prebuilt index", field="normalize")
        index = inventory_codes
    else:
        index = CodeIndex(inventory_codes, normalize)

    def invalid(reason: str) -> Answer:
        return Answer((), False, False, reason, 0, 0, 0, capped, degenerate_reason((), capped))

    if capped:
        return invalid("capped")
    if not reasoning_closed(generation):
        return invalid("unclosed_think")
    _, answer_part = split_reasoning(generation)
    entries = last_json_list(answer_part)
    if entries is None:
        reason = "not_a_list" if _is_json(_strip_fences(answer_part)) else "no_json_list"
        return Answer((), True, False, reason, 0, 0, 0, False, "")

    codes: list[str] = []
    seen: set[str] = set()
    n_out = n_malformed = 0
    for entry in entries:
        if index.numbers and isinstance(entry, int) and not isinstance(entry, bool):
            entry = str(entry)
        if not isinstance(entry, str):
            n_malformed += 1
            continue
        code = index.lookup(entry)
        if code is None:
            n_out += 1
        elif code not in seen:
            seen.add(code)
            codes.append(code)
    answer_codes = tuple(codes)
    why = degenerate_reason(answer_codes, capped=False)
    return Answer(answer_codes, True, True, "ok", len(entries), n_out, n_malformed, bool(why), why)
