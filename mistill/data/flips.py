"""The evidence-flip test's cohort (App. N.1-N.2, R-D35): lock, seeded draw, checked edit
proposals, the reviewer's ledger, the freeze, and the four condition corpora.

A *case* is a patient's note with an emitted gold code A (the *target code*) supported by
evidence in the note and a *partner code* B. Its four versions are the conditions
(:data:`CONDITIONS`): the ``original`` note; the ``flipped`` note, whose evidence is rewritten so
that it supports B instead; an ``irrelevant`` edit of matched length; and an ``order``
permutation. App. O's evidence pairs on a free-text label space (MuSiQue-Ans answers) use the
same machinery with a paraphrase, ``control``, as the second control (:data:`PAIR_CONDITIONS`;
the cohort lock names the set). The platform drafts nothing clinical: the edits come from a proposals file
(:func:`read_proposals`), each version's edits applied to the note text, and every proposal is
checked (:func:`check_proposal`) before anything is reviewed or frozen:

* exactly one condition changed per version against the original: the original has no edits;
  the flip rewrites the evidence and nothing else (every original-side target-mask span lies
  inside text the flip replaced, every flipped-side target-mask span inside text it wrote); the
  irrelevant edit touches no original evidence span; the order edit is a permutation;
* target and sham masks (character spans of the original and the flipped text) are
  token-matched in the model's tokenizer: as many tokens under the sham as under the target, or
  the mismatch is declared in the proposal's ``exceptions`` (``mask_length``), as the paper
  records one case;
* the irrelevant edit writes as many words as the flip (or declares ``irrelevant_length``);
* the order edit rewrites each span it touches into a permutation of that span's words.

The reviewer's ledger (:func:`read_ledger`: a CSV of ``case_id, decision, reason_code,
reviewer, timestamp``) decides the first ``review.budget`` proposals in file order, accept or
exclude with a reason code of the lock. The freeze (:func:`frozen_record`, :func:`write_frozen`)
records the lock's, the ledger's and every reviewed proposal's sha256 and each accepted case's
version hashes (sha256 of each condition's text and masks); a frozen cohort read again is
re-verified against it (:func:`verify_frozen`) and anything changed since is refused.

Everything here is pure (no tracking): the ``flip_cohort`` stage reads the prepared corpus and
writes the runs. The synthetic generator (:func:`synthetic_flip_proposals`,
:func:`all_accept_ledger`) makes proposals and an all-accept ledger for the synthetic corpus, so
the chain runs in tests and smoke settings; its partner code is a sibling of A in the inventory
(**[recon]**: the synthetic inventory has no Excludes1 relation).
"""

from __future__ import annotations

import csv
import io
import json
import random
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from mistill.data.corpus import Corpus, Note
from mistill.data.inventory import Inventory
from mistill.data.prompts import remove_section
from mistill.data.synthetic import paraphrase
from mistill.errors import MistillInputError
from mistill.evaluation.parsing import parse_answer
from mistill.io import dumps, is_safe_name, iter_jsonl, read_yaml_mapping, sha256_file, sha256_text, write_text

CONDITIONS = ("original", "flipped", "irrelevant", "order")
"""The four conditions of App. N's evidence flips, in the order the paper names them."""
PAIR_CONDITIONS = ("original", "flipped", "irrelevant", "control")
"""The four conditions of App. O's evidence pairs: the second control is a meaning-preserving
paraphrase (``control``), not an order permutation."""
CONDITION_SETS: tuple[tuple[str, ...], ...] = (CONDITIONS, PAIR_CONDITIONS)
"""The condition sets a cohort lock may name (``conditions``)."""
MASKED_CONDITIONS = ("original", "flipped")
"""The conditions whose versions carry a target and a sham mask (the two sides of D)."""
DECISIONS = ("accept", "exclude")
EXCEPTIONS = ("mask_length", "irrelevant_length")
"""The check failures a proposal may declare instead of failing: kept as recorded facts."""
LEDGER_COLUMNS = ("case_id", "decision", "reason_code", "reviewer", "timestamp")
FROZEN_FILE = "FROZEN"
FROZEN_FORMAT = 1
COHORT_SPLIT = "test"
"""The split every case's note has in the condition corpora (**[recon]**: the ``evaluate`` and
``generate`` stages read it by default)."""
_REASON = re.compile(r"^[a-z0-9_]{1,40}$")
_WORD = re.compile(r"\S+")


# ------------------------------------------------------------------------------------- the lock
@dataclass(frozen=True)
class CohortLock:
    """The cohort's rules, fixed before the draw (a YAML file; its sha256 is recorded).

    draw_n, draw_seed: the seeded draw (patients; one note each). teacher_success: a note is
    eligible only if its screen trace's answer holds a gold code, and a proposal's target code
    must be one of those. disjoint: the draw must exclude at least one other corpus's patients
    (the training and test corpora). review_budget: proposals reviewed in file order.
    reason_codes: the exclusion reasons a ledger may give. conditions: one of
    :data:`CONDITION_SETS` (App. N's :data:`CONDITIONS` or App. O's :data:`PAIR_CONDITIONS`).
    """

    path: str
    sha256: str
    study: str
    description: str
    draw_n: int
    draw_seed: int
    teacher_success: bool
    disjoint: bool
    review_budget: int
    reason_codes: tuple[str, ...]
    conditions: tuple[str, ...] = CONDITIONS

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "sha256": self.sha256, "study": self.study, "description": self.description,
                "draw": {"n": self.draw_n, "seed": self.draw_seed},
                "eligibility": {"teacher_success": self.teacher_success}, "disjoint": self.disjoint,
                "review": {"budget": self.review_budget, "reason_codes": list(self.reason_codes)},
                "conditions": list(self.conditions)}


_LOCK_KEYS = {"study", "description", "draw", "eligibility", "disjoint", "review", "conditions"}


def load_cohort_lock(path: str | Path) -> CohortLock:
    """Read and check a cohort lock; every error names the file and the field. Example::

        study: ef-paper
        draw: {n: 300, seed: 0}
        eligibility: {teacher_success: true}
        disjoint: true
        review: {budget: 80, reason_codes: [no_coherent_flip, pair, evidence]}
        conditions: [original, flipped, irrelevant, order]
    """
    p = Path(path)
    data, _ = read_yaml_mapping(p, what="cohort lock", known=_LOCK_KEYS)
    for key in ("study", "draw", "eligibility", "disjoint", "review", "conditions"):
        if key not in data:
            raise MistillInputError("missing (a lock states every rule before the draw)", file=str(p), field=key)

    def fail(fld: str, message: str) -> MistillInputError:
        return MistillInputError(message, file=str(p), field=fld)

    if not isinstance(data["study"], str) or not is_safe_name(data["study"]):
        raise fail("study", f"expected a name (letters, digits, '_', '.', '-'), got {data['study']!r}")
    draw, review, elig = data["draw"], data["review"], data["eligibility"]
    if not isinstance(draw, dict) or set(draw) != {"n", "seed"}:
        raise fail("draw", "expected {n: <patients>, seed: <seed>}")
    for key, low in (("n", 1), ("seed", 0)):
        if isinstance(draw[key], bool) or not isinstance(draw[key], int) or draw[key] < low:
            raise fail(f"draw.{key}", f"expected an integer >= {low}, got {draw[key]!r}")
    if not isinstance(elig, dict) or set(elig) != {"teacher_success"} or not isinstance(elig["teacher_success"], bool):
        raise fail("eligibility", "expected {teacher_success: true|false}")
    if not isinstance(data["disjoint"], bool):
        raise fail("disjoint", f"expected true or false, got {data['disjoint']!r}")
    if not isinstance(review, dict) or set(review) != {"budget", "reason_codes"}:
        raise fail("review", "expected {budget: <proposals reviewed in order>, reason_codes: [...]}")
    budget = review["budget"]
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise fail("review.budget", f"expected a positive integer, got {budget!r}")
    reasons = review["reason_codes"]
    if (not isinstance(reasons, list) or not reasons or len(set(reasons)) != len(reasons)
            or not all(isinstance(r, str) and _REASON.match(r) for r in reasons)):
        raise fail("review.reason_codes", "expected a list of distinct codes of lowercase letters, digits and '_'")
    if data["conditions"] not in [list(c) for c in CONDITION_SETS]:
        raise fail("conditions", f"expected one of {[list(c) for c in CONDITION_SETS]}, got {data['conditions']!r}")
    description = data.get("description", "")
    if not isinstance(description, str):
        raise fail("description", "expected a string")
    return CohortLock(path=str(p), sha256=sha256_file(p), study=data["study"], description=description,
                      draw_n=draw["n"], draw_seed=draw["seed"], teacher_success=elig["teacher_success"],
                      disjoint=data["disjoint"], review_budget=budget, reason_codes=tuple(reasons),
                      conditions=tuple(data["conditions"]))


# ------------------------------------------------------------------------------------- the draw
def teacher_answer_codes(note: Note, inventory: Inventory) -> tuple[str, ...] | None:
    """The codes of the note's screen trace's answer (its ``teacher_trace``), or None when it has
    no trace or the answer is invalid (reasoning left open, no JSON list)."""
    if not note.teacher_trace:
        return None
    answer = parse_answer(note.teacher_trace, inventory.codes)
    return answer.codes if answer.valid and answer.parsed else None


def screen_eligibility(answer_codes: Sequence[str] | None, gold: Sequence[str], teacher_success: bool = True) -> str:
    """``eligible``, or why not, from a note's screen answer (``answer_codes``; None: no screen
    trace, or an invalid answer): ``no_screen``, or ``teacher_miss`` (the answer holds no gold
    code). Without ``teacher_success`` every note is eligible."""
    if not teacher_success:
        return "eligible"
    if answer_codes is None:
        return "no_screen"
    return "eligible" if set(answer_codes) & set(gold) else "teacher_miss"


def eligibility(note: Note, inventory: Inventory, teacher_success: bool = True) -> str:
    """:func:`screen_eligibility` of the note's screen trace read as a code list
    (:func:`teacher_answer_codes`)."""
    if not teacher_success:
        return "eligible"
    return screen_eligibility(teacher_answer_codes(note, inventory), note.gold_codes, teacher_success)


def draw_cohort(notes: Sequence[Note], excluded_patients: Iterable[str], n: int, seed: int) -> list[Note]:
    """The seeded draw: up to ``n`` patients not in ``excluded_patients``, one note each.

    The eligible patients (sorted) are permuted by ``numpy.random.default_rng(seed)`` and the
    first ``n`` taken; each drawn patient's note is drawn with the same generator among its
    notes sorted by id (**[recon]**: the paper says one note per patient, not which). The result
    is in draw order, which is the order proposals are expected in.
    """
    excluded = set(excluded_patients)
    by_patient: dict[str, list[Note]] = {}
    for note in notes:
        if note.patient_id not in excluded:
            by_patient.setdefault(note.patient_id, []).append(note)
    rng = np.random.default_rng(seed)
    patients = sorted(by_patient)
    order = rng.permutation(len(patients))[:n]
    drawn = []
    for i in order:
        choices = sorted(by_patient[patients[int(i)]], key=lambda x: x.note_id)
        drawn.append(choices[int(rng.integers(len(choices)))])
    return drawn


# ------------------------------------------------------------------------------------ proposals
Span = tuple[int, int]


@dataclass(frozen=True)
class Edit:
    """Replace ``text[start:end]`` with ``text`` (``start == end``: an insertion)."""

    start: int
    end: int
    text: str


@dataclass(frozen=True)
class Version:
    """One condition of a case: its edits of the original note text, and (original and
    flipped) its target and sham masks, character spans of the version's own text."""

    condition: str
    edits: tuple[Edit, ...] = ()
    target_mask: tuple[Span, ...] = ()
    sham_mask: tuple[Span, ...] = ()


@dataclass(frozen=True)
class Proposal:
    """One case as the proposals file gives it (line ``line``)."""

    case_id: str
    note_id: str
    target_code: str
    partner_code: str
    versions: Mapping[str, Version]
    exceptions: tuple[str, ...] = ()
    line: int = 0
    record: Mapping[str, Any] = field(default_factory=dict)

    @property
    def sha256(self) -> str:
        """sha256 of the proposal as given (canonical JSON of its line)."""
        return sha256_text(dumps(dict(self.record)))


def _spans(value: Any, where: str, fail) -> tuple[Span, ...]:
    if not isinstance(value, list):
        raise fail(where, "expected a list of [start, end] character spans")
    out = []
    for item in value:
        if (not isinstance(item, list) or len(item) != 2 or any(isinstance(x, bool) or not isinstance(x, int)
                                                                 for x in item)):
            raise fail(where, f"expected [start, end] integers, got {item!r}")
        out.append((item[0], item[1]))
    return tuple(sorted(out))


def _version(cond: str, raw: Any, fail) -> Version:
    where = f"versions.{cond}"
    if not isinstance(raw, dict):
        raise fail(where, "expected an object with edits (and masks)")
    allowed = {"edits", "target_mask", "sham_mask"} if cond in MASKED_CONDITIONS else {"edits"}
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise fail(f"{where}.{unknown[0]}", f"not a field of the {cond} version (fields: {sorted(allowed)})")
    edits_raw = raw.get("edits", [])
    if not isinstance(edits_raw, list):
        raise fail(f"{where}.edits", "expected a list of {start, end, text}")
    edits = []
    for e in edits_raw:
        if (not isinstance(e, dict) or set(e) != {"start", "end", "text"} or not isinstance(e["text"], str)
                or any(isinstance(e[k], bool) or not isinstance(e[k], int) for k in ("start", "end"))):
            raise fail(f"{where}.edits", "each edit is {start: int, end: int, text: str}")
        edits.append(Edit(e["start"], e["end"], e["text"]))
    masks = {}
    for key in ("target_mask", "sham_mask"):
        if key in allowed:
            if key not in raw:
                raise fail(f"{where}.{key}", "missing: the original and flipped versions carry both masks")
            masks[key] = _spans(raw[key], f"{where}.{key}", fail)
    return Version(cond, tuple(sorted(edits, key=lambda x: (x.start, x.end))), **masks)


def read_proposals(path: str | Path, conditions: Sequence[str] = CONDITIONS) -> list[Proposal]:
    """Every proposal of a JSONL file, in file order, its shape checked (the edits and masks
    against the note are :func:`check_proposal`'s). One line per case::

        {"case_id": "ef-001", "note_id": "...", "target_code": "A", "partner_code": "B",
         "exceptions": [],
         "versions": {"original": {"edits": [], "target_mask": [[s, e]], "sham_mask": [[s, e]]},
                      "flipped": {"edits": [{"start": s, "end": e, "text": "..."}],
                                  "target_mask": [...], "sham_mask": [...]},
                      "irrelevant": {"edits": [...]}, "order": {"edits": [...]}}}

    (App. O's evidence pairs, ``conditions`` :data:`PAIR_CONDITIONS`: ``control`` in place of
    ``order``.)

    Raises:
        MistillInputError: naming the file, the line, the case and the field.
    """
    p = Path(path)
    if not p.is_file():
        raise MistillInputError("proposals file not found", file=str(p), field="proposals")
    out: list[Proposal] = []
    seen: set[str] = set()
    for lineno, row in iter_jsonl(p):  # refuses a malformed line, or one that is no JSON object
        case = str(row["case_id"]) if "case_id" in row else None

        def fail(fld: str, message: str, _case=case, _line=lineno) -> MistillInputError:
            return MistillInputError(message, file=str(p), line=_line, note=_case, field=fld)

        known = {"case_id", "note_id", "target_code", "partner_code", "versions", "exceptions"}
        unknown = sorted(set(row) - known)
        if unknown:
            raise fail(unknown[0], f"not a field of a proposal (fields: {sorted(known)})")
        for key in ("case_id", "note_id", "target_code", "partner_code", "versions"):
            if key not in row:
                raise fail(key, "missing")
        for key in ("case_id", "note_id", "target_code", "partner_code"):
            if not isinstance(row[key], str) or not row[key]:
                raise fail(key, "expected a non-empty string")
        if not is_safe_name(row["case_id"]):
            raise fail("case_id", "a case id is a name (letters, digits, '_', '.', '-')")
        if row["case_id"] in seen:
            raise fail("case_id", "duplicate case id")
        seen.add(row["case_id"])
        versions = row["versions"]
        if not isinstance(versions, dict) or set(versions) != set(conditions):
            got = sorted(versions) if isinstance(versions, dict) else versions
            raise fail("versions", f"expected exactly the four conditions {list(conditions)}, got {got!r}")
        exceptions = row.get("exceptions", [])
        if not isinstance(exceptions, list) or not set(exceptions) <= set(EXCEPTIONS):
            raise fail("exceptions", f"expected a list of {list(EXCEPTIONS)}, got {exceptions!r}")
        out.append(Proposal(case_id=row["case_id"], note_id=row["note_id"], target_code=row["target_code"],
                            partner_code=row["partner_code"],
                            versions={c: _version(c, versions[c], fail) for c in conditions},
                            exceptions=tuple(sorted(set(exceptions))), line=lineno, record=row))
    return out


def apply_edits(text: str, edits: Sequence[Edit]) -> tuple[str, list[Span], list[Span]]:
    """``text`` with ``edits`` applied (sorted, non-overlapping), the replaced spans of the
    original text and the written spans of the new text, edit by edit."""
    parts, replaced, written = [], [], []
    pos, shift = 0, 0
    for e in edits:
        parts.append(text[pos:e.start])
        replaced.append((e.start, e.end))
        written.append((e.start + shift, e.start + shift + len(e.text)))
        parts.append(e.text)
        shift += len(e.text) - (e.end - e.start)
        pos = e.end
    parts.append(text[pos:])
    return "".join(parts), replaced, written


def words(text: str) -> list[str]:
    """The words of an edit (whitespace-separated runs): the unit of the irrelevant edit's
    length match (**[recon]**: the paper counts the shortfall in words)."""
    return _WORD.findall(text)


def token_offsets(tokenizer: Any, text: str) -> list[Span]:
    """Character offsets of ``text``'s tokens in the model's fast tokenizer (no special tokens)."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return [(int(a), int(b)) for a, b in enc["offset_mapping"]]


def _note_in_body(note: Note, removed: bool) -> tuple[str, Any]:
    """The note's text as the prompt shows it (:func:`mistill.data.prompts.build_prompt`: the
    discharge diagnosis removed when ``removed``, then stripped) and a map from a character of
    ``note.text`` to its index there (None for a character the prompt does not show)."""
    text = note.text
    if removed:
        cut = text.rfind(note.discharge_diagnosis)
        before, after = text[:cut], text[cut + len(note.discharge_diagnosis):]
        kept_b, kept_a = before.rstrip(), after.lstrip()
        body = remove_section(text, note.discharge_diagnosis, note_id=note.note_id)
        join = len(body) - len(kept_b) - len(kept_a)
        start_a = len(text) - len(kept_a)

        def raw(c: int) -> int | None:
            if c < len(kept_b):
                return c
            return c - start_a + len(kept_b) + join if c >= start_a else None
    else:
        body = text

        def raw(c: int) -> int | None:
            return c
    lead = len(body) - len(body.lstrip())
    shown = body.strip()

    def where(c: int) -> int | None:
        r = raw(c)
        return None if r is None or not lead <= r < lead + len(shown) else r - lead
    return shown, where


def prompt_positions(prompt: Any, note: Note, spans: Sequence[Span], tokenizer: Any) -> list[int]:
    """The token positions of ``prompt.text`` (a :class:`mistill.data.prompts.Prompt` built for
    ``note``, tokenized without special tokens) that cover any character of ``spans`` (character
    spans of ``note.text``): a token is counted when any of its characters is, as the masks'
    checks count them. Characters the prompt does not show (a removed discharge diagnosis) have
    no token. A prompt whose note part is not the note's text is refused."""
    shown, where = _note_in_body(note, bool(prompt.discharge_diagnosis_removed))
    start = prompt.user_offset + prompt.parts["note"][0]
    if prompt.text[start:start + len(shown)] != shown:
        raise MistillInputError("the prompt does not show the note's text where its note part says",
                                note=note.note_id, field="text")
    runs: list[list[int]] = []  # the shown characters of the spans, as runs in the prompt
    for c in sorted({start + w for a, b in spans for c in range(int(a), int(b)) if (w := where(c)) is not None}):
        if runs and runs[-1][1] == c:
            runs[-1][1] = c + 1
        else:
            runs.append([c, c + 1])
    return token_positions_under(token_offsets(tokenizer, prompt.text), runs) if runs else []


def token_positions_under(offsets: Sequence[Span], spans: Sequence[Span]) -> list[int]:
    """The tokens (their positions in ``offsets``) that overlap any of ``spans``: a token is masked
    if any character of it is."""
    return [i for i, (a, b) in enumerate(offsets) if b > a and any(a < e and s < b for s, e in spans)]


def tokens_under(offsets: Sequence[Span], spans: Sequence[Span]) -> int:
    """How many tokens overlap any of ``spans`` (:func:`token_positions_under`)."""
    return len(token_positions_under(offsets, spans))


def _inside(span: Span, spans: Sequence[Span]) -> bool:
    return any(s <= span[0] and span[1] <= e for s, e in spans)


def _overlaps(span: Span, spans: Sequence[Span]) -> bool:
    """Whether ``span`` shares a character with one of ``spans`` (an insertion, ``start ==
    end``, overlaps a span it falls strictly inside)."""
    return any(span[0] < e and s < span[1] for s, e in spans)


@dataclass(frozen=True)
class CheckedCase:
    """A proposal that passed every check: each condition's text, masks and gold codes, the
    token counts under its masks and the facts recorded with it (declared exceptions, empty
    original-side masks of an insertion-only flip)."""

    proposal: Proposal
    note: Note
    texts: Mapping[str, str]
    gold: Mapping[str, tuple[str, ...]]
    mask_tokens: Mapping[str, tuple[int, int]]
    edit_words: Mapping[str, int]
    facts: tuple[str, ...]

    @property
    def case_id(self) -> str:
        return self.proposal.case_id

    def masks(self, condition: str) -> tuple[tuple[Span, ...], tuple[Span, ...]]:
        version = self.proposal.versions[condition]
        return version.target_mask, version.sham_mask

    def version_sha256(self, condition: str) -> str:
        """sha256 of one condition's text and masks (canonical JSON)."""
        target, sham = self.masks(condition)
        return version_sha256(self.texts[condition], target, sham)


def version_sha256(text: str, target_mask: Sequence[Span], sham_mask: Sequence[Span]) -> str:
    """sha256 of a version: its text and its two masks, as canonical JSON."""
    return sha256_text(dumps({"text": text, "target_mask": [list(s) for s in target_mask],
                              "sham_mask": [list(s) for s in sham_mask]}))


def section_span(text: str, section: str | None) -> Span | None:
    """Where ``section`` (a note's discharge-diagnosis section) is in ``text``: its last
    occurrence, the one the prompt builder removes; None when not given or not found."""
    if not section:
        return None
    i = text.rfind(section)
    return (i, i + len(section)) if i >= 0 else None


def discharge_span(note: Note) -> Span | None:
    """Where the note's discharge-diagnosis section is, if recorded (:func:`section_span`)."""
    return section_span(note.text, note.discharge_diagnosis)


def check_proposal(proposal: Proposal, note: Note, inventory: Inventory, tokenizer: Any, *, file: str,
                   answer_codes: Sequence[str] | None = None, teacher_success: bool = True,
                   removed_section: str | None = None, free_text: bool = False) -> CheckedCase:
    """Check one proposal against its note (see the module docstring for the rules).

    answer_codes: the codes of the note's screen answer (:func:`teacher_answer_codes`); with
    ``teacher_success`` the target code must be among them. removed_section: the part of the note
    the prompt removes (its discharge-diagnosis section): no edit and no mask may touch it.
    free_text: answers are free text (App. O's evidence pairs): the target is one of the note's
    gold answers, the partner none of them (ignoring case), neither need be in the inventory, and
    the flipped version's gold is the partner alone. A ``control`` version (a paraphrase, App. O)
    may not touch the original evidence; whether it keeps the meaning is the reviewer's to say.

    Raises:
        MistillInputError: naming ``file``, the case (``note``) and the field.
    """
    case = proposal.case_id

    def fail(fld: str, message: str) -> MistillInputError:
        return MistillInputError(message, file=file, line=proposal.line or None, note=case, field=fld)

    a, b = proposal.target_code, proposal.partner_code
    if not free_text:
        for fld, code in (("target_code", a), ("partner_code", b)):
            if code not in inventory:
                raise fail(fld, f"{code!r} is not in the inventory")
    if a not in note.gold_codes:
        raise fail("target_code", f"{a} is not a gold code of note {note.note_id}")
    golds = {g.casefold() for g in note.gold_codes} if free_text else set(note.gold_codes)
    if b == a or (b.casefold() if free_text else b) in golds:
        raise fail("partner_code", f"{b} is the target or another gold code of note {note.note_id}")
    if teacher_success and (answer_codes is None or a not in answer_codes):
        raise fail("target_code", f"{a} is not in the teacher's screen answer for note {note.note_id} "
                                  "(the cohort is conditioned on teacher success)")
    original = note.text
    removed_span = section_span(original, removed_section)
    texts: dict[str, str] = {}
    replaced: dict[str, list[Span]] = {}
    written: dict[str, list[Span]] = {}
    conditions = tuple(proposal.versions)
    for cond in conditions:
        version = proposal.versions[cond]
        fld = f"versions.{cond}.edits"
        if cond == "original":
            if version.edits:
                raise fail(fld, "the original version has no edits")
        elif not version.edits:
            raise fail(fld, f"the {cond} version changes nothing: it needs at least one edit")
        last = 0
        for e in version.edits:
            if not 0 <= e.start <= e.end <= len(original):
                raise fail(fld, f"edit [{e.start}, {e.end}] is outside the note text (0..{len(original)})")
            if e.start < last:
                raise fail(fld, f"edit [{e.start}, {e.end}] overlaps the edit before it")
            last = e.end
            if removed_span is not None and _overlaps((e.start, e.end), [removed_span]):
                raise fail(fld, f"edit [{e.start}, {e.end}] touches the discharge-diagnosis section, which "
                                "the prompt removes")
        texts[cond], replaced[cond], written[cond] = apply_edits(original, version.edits)
        if cond != "original" and texts[cond] == original:
            raise fail(fld, f"the {cond} version's edits leave the note text unchanged")
    offsets: dict[str, list[Span]] = {}
    mask_tokens: dict[str, tuple[int, int]] = {}
    facts: list[str] = []
    for cond in MASKED_CONDITIONS:
        version = proposal.versions[cond]
        text = texts[cond]
        for key, spans in (("target_mask", version.target_mask), ("sham_mask", version.sham_mask)):
            for s, e in spans:
                if not 0 <= s < e <= len(text):
                    raise fail(f"versions.{cond}.{key}", f"span [{s}, {e}] is empty or outside the {cond} text "
                                                         f"(0..{len(text)})")
            removed = section_span(text, removed_section)
            if removed is not None and any(_overlaps(sp, [removed]) for sp in spans):
                raise fail(f"versions.{cond}.{key}", "a span lies in the discharge-diagnosis section, which "
                                                     "the prompt removes")
        if any(_overlaps(sp, version.target_mask) for sp in version.sham_mask):
            raise fail(f"versions.{cond}.sham_mask", "the sham mask overlaps the target mask")
        if not version.target_mask and not version.sham_mask:
            if cond == "flipped":
                raise fail(f"versions.{cond}.target_mask", "the flipped version's masks are empty: the flip "
                                                           "writes the evidence for the partner code")
            facts.append("empty_original_masks")
        offsets[cond] = token_offsets(tokenizer, text)
        n_target = tokens_under(offsets[cond], version.target_mask)
        n_sham = tokens_under(offsets[cond], version.sham_mask)
        mask_tokens[cond] = (n_target, n_sham)
        if n_target != n_sham:
            if "mask_length" not in proposal.exceptions:
                raise fail(f"versions.{cond}.sham_mask",
                           f"not token-matched: {n_sham} tokens under the sham mask, {n_target} under the "
                           "target mask (declare 'mask_length' in exceptions to keep the case)")
            facts.append(f"mask_length_{cond}:{n_target}/{n_sham}")
    flip = proposal.versions["flipped"]
    for span in proposal.versions["original"].target_mask:
        if not _inside(span, replaced["flipped"]):
            raise fail("versions.flipped.edits", f"the original evidence [{span[0]}, {span[1]}] is not inside "
                                                 "text the flip replaced: the flip rewrites the evidence")
    for span in flip.target_mask:
        if not _inside(span, written["flipped"]):
            raise fail("versions.flipped.target_mask", f"span [{span[0]}, {span[1]}] is not inside text the "
                                                       "flip wrote")
    for cond in ("irrelevant", "control"):
        for e in proposal.versions[cond].edits if cond in proposal.versions else ():
            if _overlaps((e.start, e.end), proposal.versions["original"].target_mask):
                raise fail(f"versions.{cond}.edits", f"edit [{e.start}, {e.end}] touches the evidence: the "
                                                     f"{cond} edit leaves the evidence as it is")
    edit_words = {c: sum(len(words(e.text)) for e in proposal.versions[c].edits) for c in conditions}
    if edit_words["irrelevant"] != edit_words["flipped"]:
        if "irrelevant_length" not in proposal.exceptions:
            raise fail("versions.irrelevant.edits",
                       f"length not matched: the irrelevant edit writes {edit_words['irrelevant']} words, the "
                       f"flip {edit_words['flipped']} (declare 'irrelevant_length' in exceptions to keep the case)")
        facts.append(f"irrelevant_length:{edit_words['irrelevant']}/{edit_words['flipped']}")
    for e in proposal.versions["order"].edits if "order" in proposal.versions else ():
        old = words(original[e.start:e.end])
        if Counter(old) != Counter(words(e.text)):
            raise fail("versions.order.edits", f"edit [{e.start}, {e.end}] is not a permutation of the words "
                                               "it replaces")
    for declared in proposal.exceptions:
        if not any(f.startswith(declared) for f in facts):
            raise fail("exceptions", f"{declared!r} is declared but its check passes: declare only what fails")
    gold = {c: note.gold_codes for c in conditions}
    gold["flipped"] = (b,) if free_text else tuple(b if c == a else c for c in note.gold_codes)
    return CheckedCase(proposal=proposal, note=note, texts=texts, gold=gold, mask_tokens=mask_tokens,
                       edit_words=edit_words, facts=tuple(sorted(set(facts))))


def check_proposals(proposals: Sequence[Proposal], drawn: Sequence[Note], inventory: Inventory, tokenizer: Any, *,
                    file: str, teacher_success: bool = True, removes_discharge_diagnosis: bool = True,
                    screen: Mapping[str, Sequence[str] | None] | None = None,
                    free_text: bool = False) -> list[CheckedCase]:
    """:func:`check_proposal` on every proposal, each naming a drawn, eligible note, at most one
    proposal per patient. ``screen``: each drawn note's screen answer (note id -> codes, None for
    none), when the label space reads answers otherwise than :func:`teacher_answer_codes`."""
    by_id = {n.note_id: n for n in drawn}
    patients: dict[str, str] = {}
    out = []
    for proposal in proposals:
        note = by_id.get(proposal.note_id)
        if note is None:
            raise MistillInputError(f"note {proposal.note_id} is not in the draw", file=file, line=proposal.line,
                                    note=proposal.case_id, field="note_id")
        if note.patient_id in patients:
            raise MistillInputError(f"a second proposal for the patient of case {patients[note.patient_id]}: "
                                    "one case per patient", file=file, line=proposal.line, note=proposal.case_id,
                                    field="note_id")
        patients[note.patient_id] = proposal.case_id
        answer = screen[note.note_id] if screen is not None else teacher_answer_codes(note, inventory)
        status = screen_eligibility(answer, note.gold_codes, teacher_success)
        if status != "eligible":
            raise MistillInputError(f"note {note.note_id} is not eligible ({status})",
                                    file=file, line=proposal.line, note=proposal.case_id, field="note_id")
        out.append(check_proposal(proposal, note, inventory, tokenizer, file=file, answer_codes=answer,
                                  teacher_success=teacher_success, free_text=free_text,
                                  removed_section=note.discharge_diagnosis if removes_discharge_diagnosis else None))
    return out


# ----------------------------------------------------------------------------------- the ledger
@dataclass(frozen=True)
class Decision:
    """One row of the reviewer's ledger."""

    case_id: str
    decision: str
    reason_code: str
    reviewer: str
    timestamp: str

    def to_dict(self) -> dict[str, str]:
        return {k: getattr(self, k) for k in LEDGER_COLUMNS}


def reviewed_proposals(proposals: Sequence[Proposal], budget: int) -> list[Proposal]:
    """The proposals the review reaches: the first ``budget``, in file order."""
    return list(proposals[:budget])


def read_ledger(path: str | Path, proposals: Sequence[Proposal], lock: CohortLock) -> list[Decision]:
    """The reviewer's decisions, checked against the proposals: one row per reviewed proposal
    (the first ``review.budget`` in file order; none for a proposal the review did not reach),
    ``accept`` or ``exclude`` with one of the lock's reason codes (an accepted case gives none),
    a reviewer and an ISO 8601 timestamp. Returned in proposal order.

    Raises:
        MistillInputError: naming the file, the line, the case and the column.
    """
    p = Path(path)
    if not p.is_file():
        raise MistillInputError("ledger file not found", file=str(p), field="ledger")
    rows = list(csv.reader(io.StringIO(p.read_text(encoding="utf-8"))))
    if not rows or tuple(c.strip() for c in rows[0]) != LEDGER_COLUMNS:
        raise MistillInputError(f"the header must be {','.join(LEDGER_COLUMNS)}", file=str(p), line=1,
                                field="header")
    reviewed = reviewed_proposals(proposals, lock.review_budget)
    order = {pr.case_id: i for i, pr in enumerate(proposals)}
    wanted = {pr.case_id for pr in reviewed}
    decisions: dict[str, Decision] = {}
    for lineno, row in enumerate(rows[1:], start=2):
        if not any(c.strip() for c in row):
            continue
        if len(row) != len(LEDGER_COLUMNS):
            raise MistillInputError(f"expected {len(LEDGER_COLUMNS)} columns, got {len(row)}", file=str(p),
                                    line=lineno, field="row")
        d = Decision(*(c.strip() for c in row))

        def fail(fld: str, message: str, _d=d, _line=lineno) -> MistillInputError:
            return MistillInputError(message, file=str(p), line=_line, note=_d.case_id or None, field=fld)

        if d.case_id not in order:
            raise fail("case_id", "no proposal has this case id")
        if d.case_id not in wanted:
            raise fail("case_id", f"proposal {order[d.case_id] + 1} is beyond the review budget of "
                                  f"{lock.review_budget}: the review does not reach it")
        if d.case_id in decisions:
            raise fail("case_id", "a second decision for this case")
        if d.decision not in DECISIONS:
            raise fail("decision", f"expected one of {list(DECISIONS)}, got {d.decision!r}")
        if d.decision == "exclude" and d.reason_code not in lock.reason_codes:
            raise fail("reason_code", f"an exclusion gives one of the lock's reason codes {list(lock.reason_codes)}, "
                                      f"got {d.reason_code!r}")
        if d.decision == "accept" and d.reason_code:
            raise fail("reason_code", "an accepted case gives no reason code")
        if not d.reviewer:
            raise fail("reviewer", "empty: every decision names its reviewer")
        try:
            datetime.fromisoformat(d.timestamp)
        except ValueError:
            raise fail("timestamp", f"expected an ISO 8601 date and time, got {d.timestamp!r}") from None
        decisions[d.case_id] = d
    missing = [pr.case_id for pr in reviewed if pr.case_id not in decisions]
    if missing:
        raise MistillInputError(f"{len(missing)} reviewed proposals have no decision (first: {missing[0]}); the "
                                f"review covers the first {lock.review_budget} proposals in order", file=str(p),
                                note=missing[0], field="case_id")
    return [decisions[pr.case_id] for pr in reviewed]


def write_ledger(path: str | Path, decisions: Iterable[Decision]) -> Path:
    """Write a ledger CSV (:data:`LEDGER_COLUMNS`)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(LEDGER_COLUMNS)
    for d in decisions:
        writer.writerow([getattr(d, k) for k in LEDGER_COLUMNS])
    return write_text(path, buf.getvalue())


# ----------------------------------------------------------------------------------- the freeze
def frozen_record(lock: CohortLock, ledger_sha256: str, proposals: Sequence[Proposal],
                  decisions: Sequence[Decision], accepted: Sequence[CheckedCase], corpus_digest: str) -> dict[str, Any]:
    """What the freeze records: the lock's and the ledger's sha256, the source corpus's digest,
    every reviewed proposal's sha256 and decision, and each accepted case's codes, recorded facts
    and version hashes (:meth:`CheckedCase.version_sha256`)."""
    by_id = {p.case_id: p for p in proposals}
    return {
        "format": FROZEN_FORMAT, "lock_sha256": lock.sha256, "ledger_sha256": ledger_sha256,
        "source_corpus_digest": corpus_digest, "review_budget": lock.review_budget,
        "reviewed": [{"case_id": d.case_id, "note_id": by_id[d.case_id].note_id, "decision": d.decision,
                      "reason_code": d.reason_code, "proposal_sha256": by_id[d.case_id].sha256} for d in decisions],
        "cases": [{"case_id": c.case_id, "note_id": c.note.note_id, "target_code": c.proposal.target_code,
                   "partner_code": c.proposal.partner_code, "facts": list(c.facts),
                   "versions": {cond: c.version_sha256(cond) for cond in c.proposal.versions}} for c in accepted],
    }


def write_frozen(path: str | Path, record: Mapping[str, Any]) -> Path:
    """Write the ``FROZEN`` file (canonical JSON, one key per line)."""
    return write_text(path, json.dumps(record, indent=1, sort_keys=True) + "\n")


def verify_frozen(path: str | Path, record: Mapping[str, Any]) -> None:
    """Refuse a cohort that differs from its freeze: ``record`` (the cohort as read now, from
    :func:`frozen_record`) must equal the ``FROZEN`` file at ``path``.

    Raises:
        MistillInputError: naming the file, the case (``note``) and the first field that differs.
    """
    p = Path(path)
    try:
        frozen = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise MistillInputError(f"unreadable FROZEN file ({type(exc).__name__})", file=str(p)) from None

    def fail(fld: str, message: str, case: str | None = None) -> MistillInputError:
        return MistillInputError(f"changed after freezing: {message}; a frozen cohort is never changed",
                                 file=str(p), note=case, field=fld)

    for key in ("format", "lock_sha256", "ledger_sha256", "source_corpus_digest", "review_budget"):
        if frozen.get(key) != record.get(key):
            raise fail(key, f"{key} is {record.get(key)!r} now, {frozen.get(key)!r} when frozen")
    then = {r["case_id"]: r for r in frozen.get("reviewed", [])}
    now = {r["case_id"]: r for r in record["reviewed"]}
    for case in list(then) + [c for c in now if c not in then]:
        if case not in now or case not in then:
            raise fail("reviewed", f"case {case} is {'no longer' if case not in now else 'newly'} reviewed", case)
        for key in ("note_id", "decision", "reason_code", "proposal_sha256"):
            if then[case].get(key) != now[case].get(key):
                raise fail(f"reviewed.{key}", f"case {case}'s {key} differs", case)
    if [r["case_id"] for r in frozen.get("reviewed", [])] != [r["case_id"] for r in record["reviewed"]]:
        raise fail("reviewed", "the review order differs")
    then_cases = {c["case_id"]: c for c in frozen.get("cases", [])}
    for case in record["cases"]:
        old = then_cases.get(case["case_id"])
        if old is None:
            raise fail("cases", f"case {case['case_id']} was not accepted when frozen", case["case_id"])
        for key in ("note_id", "target_code", "partner_code", "facts"):
            if old.get(key) != case[key]:
                raise fail(key, f"case {case['case_id']}'s {key} differs", case["case_id"])
        for cond in case["versions"]:
            if old.get("versions", {}).get(cond) != case["versions"][cond]:
                raise fail(f"versions.{cond}", f"the {cond} version's text or masks differ (sha256)",
                           case["case_id"])
    if set(then_cases) - {c["case_id"] for c in record["cases"]}:
        case = sorted(set(then_cases) - {c["case_id"] for c in record["cases"]})[0]
        raise fail("cases", f"case {case} was accepted when frozen and is missing now", case)


# ----------------------------------------------------------------------------------- the cohort
def condition_corpus(source: Corpus, cases: Sequence[CheckedCase], condition: str, name: str) -> Corpus:
    """The accepted cases under one condition, as a corpus: each case's note with the
    condition's text and gold codes (the flip's A replaced by B; **[recon]**), split
    :data:`COHORT_SPLIT`, no teacher trace (the screen traces are withheld), the same shortlist in
    every condition (the source's, with A and B added when absent, so the prompts differ only in
    the note), and ``meta`` holding the case, its codes, its masks (spans of this condition's
    text) and its recorded facts."""
    if any(condition not in c.proposal.versions for c in cases):
        raise ValueError(f"unknown condition {condition!r}")
    notes = []
    inventory = source.inventory
    for c in cases:
        note = c.note
        target, sham = c.masks(condition)
        shortlist = note.shortlist
        if shortlist is not None:
            extra = [x for x in (c.proposal.target_code, c.proposal.partner_code) if x not in shortlist]
            in_inventory_order = all(x in inventory for x in extra) and \
                list(shortlist) == sorted(shortlist, key=inventory.index)
            shortlist = tuple(sorted([*shortlist, *extra], key=inventory.index) if in_inventory_order
                              else [*shortlist, *extra])
        meta = {"flip_case": c.case_id, "flip_condition": condition, "target_code": c.proposal.target_code,
                "partner_code": c.proposal.partner_code, "target_mask": [list(s) for s in target],
                "sham_mask": [list(s) for s in sham], "facts": list(c.facts),
                "version_sha256": c.version_sha256(condition)}
        dd = note.discharge_diagnosis if note.discharge_diagnosis and note.discharge_diagnosis in c.texts[condition] \
            else None
        notes.append(replace(note, split=COHORT_SPLIT, text=c.texts[condition], gold_codes=c.gold[condition],
                             teacher_trace=None, discharge_diagnosis=dd, meta=meta, shortlist=shortlist))
    return Corpus(name=name, privacy=source.privacy, notes=notes, inventory=inventory, meta=dict(source.meta))


def accounting(drawn: Sequence[Note], eligibility_of: Mapping[str, str], proposals: Sequence[Proposal],
               decisions: Sequence[Decision] | None, review_budget: int) -> dict[str, Any]:
    """The population's accounting (App. N.2): drawn, eligible (and why not), proposals,
    patients without one, reviewed = accepted + excluded (by reason), not reached."""
    reasons = Counter(eligibility_of[n.note_id] for n in drawn)
    out: dict[str, Any] = {"drawn": len(drawn), "eligible": reasons.get("eligible", 0),
                           "ineligible": {k: v for k, v in sorted(reasons.items()) if k != "eligible"},
                           "proposals": len(proposals), "patients_without_proposal": len(drawn) - len(proposals),
                           "review_budget": review_budget}
    if decisions is not None:
        excluded = Counter(d.reason_code for d in decisions if d.decision == "exclude")
        out.update(reviewed=len(decisions), accepted=sum(d.decision == "accept" for d in decisions),
                   excluded=sum(excluded.values()), excluded_by_reason=dict(sorted(excluded.items())),
                   not_reached=len(proposals) - len(decisions))
    return out


# ---------------------------------------------------------------------------- synthetic cases
_FILLER = ("the visitor parking arrangements were reviewed with the family before the weekend and the "
           "television in the room was repaired while lunch was served on the ward").split()


def _occurrences(text: str, needle: str, avoid: Span | None) -> list[Span]:
    out, i = [], text.find(needle)
    while i >= 0:
        span = (i, i + len(needle))
        if avoid is None or not _overlaps(span, [avoid]):
            out.append(span)
        i = text.find(needle, i + len(needle))
    return out


def sham_span(offsets: Sequence[Span], n: int, forbidden: Sequence[Span]) -> tuple[Span, ...] | None:
    """A run of ``n`` consecutive tokens touching no forbidden span, as one character span."""
    run: list[Span] = []
    for a, b in offsets:
        if b <= a or _overlaps((a, b), forbidden):
            run = []
            continue
        run.append((a, b))
        if len(run) == n:
            return ((run[0][0], run[-1][1]),)
    return None


def synthetic_flip_proposal(note: Note, inventory: Inventory, tokenizer: Any, rng: random.Random, *,
                            case_id: str) -> dict[str, Any] | None:
    """One proposal (a proposals-file record) for a synthetic note, or None when the note offers
    none: the target code A is a gold code the screen answer holds whose paraphrase appears
    outside the discharge-diagnosis section; the partner B a sibling of A outside the gold codes;
    the flip writes B's paraphrase over every such occurrence; the irrelevant edit inserts as
    many filler words into the social history; the order edit reverses the hospital course's
    lines; the shams are token-matched runs of non-evidence tokens."""
    answer = set(teacher_answer_codes(note, inventory) or ())
    avoid = discharge_span(note)
    text = note.text
    for a in [c for c in note.gold_codes if c in answer]:
        para_a = paraphrase(inventory.description(a))
        found = _occurrences(text, para_a, avoid)
        partners = [s for s in inventory.siblings(a) if s not in note.gold_codes
                    and paraphrase(inventory.description(s)) != para_a]
        if not found or not partners:
            continue
        b = rng.choice(sorted(partners))
        para_b = paraphrase(inventory.description(b))
        flip_edits = [{"start": s, "end": e, "text": para_b} for s, e in found]
        n_words = len(words(para_b)) * len(found)
        social = text.find("Social history:\n")
        course = text.find("Hospital course:\n")
        if social < 0 or course < 0:
            return None
        course_start = course + len("Hospital course:\n")
        course_end = text.find("\n\n", course_start)
        lines = text[course_start:course_end].split("\n")
        if len(set(lines)) < 2:
            return None
        filler = " ".join((_FILLER * (n_words // len(_FILLER) + 1))[:n_words])
        insert_at = social + len("Social history:\n")
        flipped_text, _, written = apply_edits(text, [Edit(s, e, para_b) for s, e in found])
        masks = {}
        for cond, body, target in (("original", text, found), ("flipped", flipped_text, written)):
            offsets = token_offsets(tokenizer, body)
            n = tokens_under(offsets, target)
            removed = section_span(body, note.discharge_diagnosis)
            sham = sham_span(offsets, n, list(target) + ([removed] if removed else []))
            if sham is None:
                return None
            masks[cond] = {"target_mask": [list(s) for s in target], "sham_mask": [list(s) for s in sham]}
        return {"case_id": case_id, "note_id": note.note_id, "target_code": a, "partner_code": b, "exceptions": [],
                "versions": {"original": {"edits": [], **masks["original"]},
                             "flipped": {"edits": flip_edits, **masks["flipped"]},
                             "irrelevant": {"edits": [{"start": insert_at, "end": insert_at,
                                                       "text": filler[:1].upper() + filler[1:] + ". "}]},
                             "order": {"edits": [{"start": course_start, "end": course_end,
                                                  "text": "\n".join(reversed(lines))}]}}}
    return None


def synthetic_flip_proposals(notes: Sequence[Note], inventory: Inventory, tokenizer: Any, *,
                             seed: int = 0) -> list[dict[str, Any]]:
    """Proposals (proposals-file records, in ``notes``' order, case ids ``ef-001``, ...) for the
    synthetic notes that offer one (:func:`synthetic_flip_proposal`). For tests and smoke
    settings: a synthetic corpus only."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    for note in notes:
        record = synthetic_flip_proposal(note, inventory, tokenizer, rng, case_id=f"ef-{len(out) + 1:03d}")
        if record is not None:
            out.append(record)
    return out


def write_proposals(path: str | Path, records: Iterable[Mapping[str, Any]]) -> Path:
    """Write proposals-file records as JSONL."""
    return write_text(path, "".join(json.dumps(dict(r), sort_keys=True) + "\n" for r in records))


def all_accept_ledger(records: Sequence[Mapping[str, Any]], budget: int, *, reviewer: str = "synthetic",
                      timestamp: str = "2000-01-01T00:00:00+00:00") -> list[Decision]:
    """A ledger accepting every reviewed proposal (the first ``budget``): synthetic cases only."""
    return [Decision(str(r["case_id"]), "accept", "", reviewer, timestamp) for r in records[:budget]]


__all__ = ["CONDITIONS", "PAIR_CONDITIONS", "CONDITION_SETS", "screen_eligibility", "sham_span", "MASKED_CONDITIONS",
           "DECISIONS", "EXCEPTIONS", "LEDGER_COLUMNS", "FROZEN_FILE", "COHORT_SPLIT", "CohortLock", "load_cohort_lock", "teacher_answer_codes", "eligibility", "draw_cohort",
           "Edit", "Version", "Proposal", "read_proposals", "apply_edits", "words", "token_offsets", "prompt_positions",
           "token_positions_under", "tokens_under",
           "CheckedCase", "version_sha256", "section_span", "discharge_span", "check_proposal", "check_proposals", "Decision",
           "reviewed_proposals", "read_ledger", "write_ledger", "frozen_record", "write_frozen", "verify_frozen",
           "condition_corpus", "accounting", "synthetic_flip_proposal", "synthetic_flip_proposals",
           "write_proposals", "all_accept_ledger"]
