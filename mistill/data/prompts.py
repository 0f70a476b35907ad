"""The coding prompt of App. A/B, with the character span of every part and every inventory line.

Layout of the user turn (``user_text``), parts in order::

    <header>\\n
    <line 1>\\n<line 2>\\n...<line K>\\n
    \\n
    <summary_header>\\n
    <note>\\n
    \\n
    <instruction>

The sentences are the inventory's task's (:class:`PromptWording`; ICD-10-CM's below).
``header`` names the list as the assignable ICD-10-CM diagnosis codes; ``lines`` are the
candidate lines ``"<code> <description>"`` (the full inventory in its shared order, or a
shortlist in the given order); ``summary_header`` introduces the discharge summary; ``note`` is
the summary (without its discharge-diagnosis section when asked and known); ``instruction``
gives the clinical-coder role, the task, points to the complete list above, asks (switchable) to
narrow first to the clinically plausible region and then decide among its specific codes, and
asks for a JSON list of code strings.

A task whose wording shows no list (:attr:`PromptWording.shows_list`, MuSiQue-Ans) starts the
user turn at ``<summary_header>``: its prompt has no ``header`` and no ``lines`` part.

The user turn is wrapped in the model's chat template (one user message, generation prompt
added, thinking on where the template has a switch). Every span is a ``(start, end)`` character
range into ``user_text``; add ``user_offset`` for the range in ``text``. The read side builds its
categories and span buckets from them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mistill.data.corpus import Note
from mistill.data.inventory import Inventory, as_code_list
from mistill.errors import MistillInputError

__all__ = ["Prompt", "build_prompt", "remove_section", "chat_template_source",
           "template_has_thinking", "HEADER", "SUMMARY_HEADER", "NARROW_SENTENCE",
           "PART_NAMES", "PromptWording", "ICD10_WORDING", "instruction_text", "wording_of"]

PART_NAMES = ("header", "lines", "summary_header", "note", "instruction")

HEADER = ("Below is the list of assignable ICD-10-CM diagnosis codes, one per line: the code, "
          "then its description.")
SUMMARY_HEADER = "Here is the discharge summary to code:"
_ROLE_AND_TASK = ("You are an experienced clinical coder. Assign ICD-10-CM diagnosis codes to "
                  "the discharge summary above, choosing only from the complete list of "
                  "assignable codes given above it.")
NARROW_SENTENCE = ("Narrow down first to the clinically plausible region of the list, then "
                   "decide among the specific codes within it.")
_ANSWER = ("Give your final answer as a JSON list of code strings, with every code written "
           "exactly as it appears in the list.")


@dataclass(frozen=True)
class PromptWording:
    """The task's sentences of the prompt: the list's header, the input's header, the role and
    task, the narrowing sentence and the answer format (the layout is every task's)."""

    header: str
    summary_header: str
    role_and_task: str
    narrow_sentence: str
    answer: str
    shows_list: bool = True
    """False for a task whose prompt lists no candidates (MuSiQue-Ans: the passages and the
    question are the input): the prompt then has no ``header`` and no ``lines`` part."""


ICD10_WORDING = PromptWording(HEADER, SUMMARY_HEADER, _ROLE_AND_TASK, NARROW_SENTENCE, _ANSWER)
"""The paper's prompt (App. A/B)."""


def instruction_text(narrow_instruction: bool = True, wording: PromptWording = ICD10_WORDING) -> str:
    """The instruction paragraph; ``narrow_instruction=False`` drops only the narrowing sentence
    (the instruction control of App. A)."""
    parts = [wording.role_and_task] + ([wording.narrow_sentence] if narrow_instruction else []) + [wording.answer]
    return " ".join(parts)


def wording_of(inventory: Inventory, wording: PromptWording | None = None) -> PromptWording:
    """The prompt wording of the inventory's task (:attr:`Inventory.task`): ``wording`` when given
    (:func:`mistill.tasks.prompt_wording` gives every task's), else the ICD-10-CM wording, which
    is the only one this module knows."""
    if wording is not None:
        return wording
    if inventory.task == "icd10":
        return ICD10_WORDING
    raise MistillInputError(f"the inventory's task {inventory.task!r} has its own prompt wording: pass it "
                            "(mistill.tasks.prompt_wording)", field="task")


def remove_section(text: str, section: str, *, note_id: str | None = None) -> str:
    """``text`` without its (last) occurrence of ``section``, whitespace around the cut merged.

    The gap closes with the larger line break found on either side of the cut (a blank line at
    most), or a space when neither side had one. A section not found in the text raises (a
    stale record).
    """
    i = text.rfind(section)
    if i < 0:
        raise MistillInputError("discharge-diagnosis section not found in the note text",
                                note=note_id, field="discharge_diagnosis")
    before, after = text[:i], text[i + len(section):]
    b, a = before.rstrip(), after.lstrip()
    if not b or not a:
        return b + a
    n_newlines = max(before[len(b):].count("\n"), after[: len(after) - len(a)].count("\n"))
    return b + ("\n" * min(n_newlines, 2) or " ") + a


def chat_template_source(tokenizer: Any) -> str | None:
    """The tokenizer's chat template text (the ``default`` one when it holds several)."""
    tpl = getattr(tokenizer, "chat_template", None)
    if isinstance(tpl, dict):
        tpl = tpl.get("default") or next(iter(tpl.values()), None)
    return tpl if isinstance(tpl, str) and tpl.strip() else None


def template_has_thinking(tokenizer: Any) -> bool:
    """Whether the chat template has a thinking switch (mentions ``enable_thinking``)."""
    src = chat_template_source(tokenizer)
    return src is not None and "enable_thinking" in src


@dataclass(frozen=True)
class Prompt:
    """A built prompt.

    user_text: the untemplated user turn.
    parts: part name -> ``(start, end)`` in ``user_text`` for ``header``, ``lines`` (the whole
        block, first line start to last line end), ``summary_header``, ``note``, ``instruction``
        (no ``header`` and ``lines`` where the wording shows no list).
    line_spans: code -> ``(start, end)`` of its line ``"<code> <description>"`` in ``user_text``.
    codes: the candidate codes in prompt order (none where the wording shows no list).
    text: the chat-templated prompt ending with the generation prompt (``== user_text`` when no
        tokenizer was given).
    user_offset: where ``user_text`` starts inside ``text``.
    thinking: whether the template has a thinking switch (it was set on).
    """

    user_text: str
    parts: dict[str, tuple[int, int]]
    line_spans: dict[str, tuple[int, int]]
    codes: tuple[str, ...]
    text: str
    user_offset: int
    thinking: bool
    note_id: str | None = None
    narrow_instruction: bool = True
    discharge_diagnosis_removed: bool = False
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def trace_offset(self) -> int:
        """Character offset in ``full_text(trace)`` where the trace begins (``len(text)``)."""
        return len(self.text)

    def full_text(self, trace: str) -> str:
        """The prompt followed by a generated trace (teacher forcing input)."""
        return self.text + trace

    def part(self, name: str) -> str:
        s, e = self.parts[name]
        return self.user_text[s:e]

    def span_in_text(self, name: str) -> tuple[int, int]:
        """A part's span shifted into ``text``."""
        s, e = self.parts[name]
        return s + self.user_offset, e + self.user_offset

    def line_span_in_text(self, code: str) -> tuple[int, int]:
        """A code line's span shifted into ``text``."""
        s, e = self.line_spans[code]
        return s + self.user_offset, e + self.user_offset


def _apply_template(tokenizer: Any, user_text: str) -> tuple[str, bool]:
    src = chat_template_source(tokenizer)
    if src is None:
        raise MistillInputError("the tokenizer has no chat template; the prompt is one user "
                                "turn of the model's chat template", field="chat_template")
    thinking = "enable_thinking" in src
    kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": True}
    if thinking:
        kwargs["enable_thinking"] = True
    text = tokenizer.apply_chat_template([{"role": "user", "content": user_text}], **kwargs)
    if not isinstance(text, str):
        raise MistillInputError("apply_chat_template did not return a string",
                                field="chat_template")
    return text, thinking


def build_prompt(note: Note, candidate_codes: Sequence[str] | None, inventory: Inventory,
                 tokenizer: Any = None, *, remove_discharge_diagnosis: bool = True,
                 narrow_instruction: bool = True, wording: PromptWording | None = None) -> Prompt:
    """Build the coding prompt for ``note`` (App. A/B).

    candidate_codes: the lines to list, in this order (a shortlist), or None for the full
        inventory in its shared order; ignored where the wording shows no list. Codes are normalised; unknown or repeated codes raise.
    tokenizer: a transformers tokenizer whose chat template wraps the user turn; None leaves
        ``text == user_text`` (``thinking=False``). A tokenizer without a chat template raises.
    remove_discharge_diagnosis: drop ``note.discharge_diagnosis`` from the note when known.
    narrow_instruction: keep the narrow-then-decide sentence (False: the instruction control).
    wording: the task's prompt sentences (:func:`mistill.tasks.prompt_wording`); None: the
        ICD-10-CM wording, for an ICD-10-CM inventory only.
    """
    wording = wording_of(inventory, wording)
    codes = as_code_list(candidate_codes, inventory) if wording.shows_list else ()
    if wording.shows_list and not codes:
        raise MistillInputError("empty candidate list", note=note.note_id,
                                field="candidate_codes")
    body = note.text
    removed = False
    if remove_discharge_diagnosis and note.discharge_diagnosis:
        body = remove_section(body, note.discharge_diagnosis, note_id=note.note_id)
        removed = True
    body = body.strip()
    if not body:
        raise MistillInputError("note text is empty", note=note.note_id, field="text")

    pieces: list[str] = []
    pos = 0
    parts: dict[str, tuple[int, int]] = {}

    def put(s: str) -> tuple[int, int]:
        nonlocal pos
        start = pos
        pieces.append(s)
        pos += len(s)
        return start, pos

    line_spans: dict[str, tuple[int, int]] = {}
    if wording.shows_list:
        parts["header"] = put(wording.header)
        put("\n")
        desc = inventory.descriptions
        for i, c in enumerate(codes):
            if i:
                put("\n")
            line_spans[c] = put(f"{c} {desc[c]}")
        parts["lines"] = (line_spans[codes[0]][0], line_spans[codes[-1]][1])
        put("\n\n")
    parts["summary_header"] = put(wording.summary_header)
    put("\n")
    parts["note"] = put(body)
    put("\n\n")
    parts["instruction"] = put(instruction_text(narrow_instruction, wording))
    user_text = "".join(pieces)

    if tokenizer is None:
        text, thinking, offset = user_text, False, 0
    else:
        text, thinking = _apply_template(tokenizer, user_text)
        offset = text.find(user_text)
        if offset < 0:
            raise MistillInputError("the chat template altered the user turn (its text is not "
                                    "found verbatim in the templated prompt)", note=note.note_id,
                                    field="chat_template")
        if text.find(user_text, offset + 1) >= 0:
            raise MistillInputError("the user turn occurs twice in the templated prompt",
                                    note=note.note_id, field="chat_template")
    return Prompt(user_text=user_text, parts=parts, line_spans=line_spans, codes=codes,
                  text=text, user_offset=offset, thinking=thinking, note_id=note.note_id,
                  narrow_instruction=narrow_instruction, discharge_diagnosis_removed=removed)
