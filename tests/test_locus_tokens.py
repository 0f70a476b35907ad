"""Token classes around a locus (Table 27) and the previous-code boundary of the window."""

from __future__ import annotations

import re

from mistill.data.inventory import Inventory
from mistill.instrument.locus_tokens import (DescriptionWords, class_shares, classify_tokens, description_words,
                                             mention_token_spans, previous_code_end)

CODES = ["I10", "I50.9", "N18.9", "E11.9", "I25.10"]


def _words_tokenize(text: str) -> list[tuple[int, int]]:
    """Whitespace-led word pieces and single punctuation marks, like a BPE tokenizer's spans."""
    return [(m.start(), m.end()) for m in re.finditer(r"\s?[A-Z][0-9][0-9A-Z.]*|\s?[A-Za-z]+|\s?[0-9]+|\s?[^\sA-Za-z0-9]", text)]


def test_description_words_drop_short_and_structural_words():
    assert description_words("Heart failure, unspecified") == {"heart", "failure"}
    assert description_words("Type 2 diabetes mellitus without complications") == {
        "diabetes", "mellitus", "complications"}


def test_tokens_take_the_class_of_their_word():
    inv = Inventory.billable(codes=CODES)
    words = DescriptionWords(inv)
    text = "the kidney shows failure and diabetes , see N18.9 then"
    offsets = _words_tokenize(text)
    pieces = [text[s:e].strip() for s, e in offsets]
    spans = [(m.start(), m.end()) for m in re.finditer(r"N18\.9", text)]
    classes = dict(zip(pieces, classify_tokens(text, offsets, range(len(offsets)), "I50.9", words, spans)))
    # emitted I50.9 (Heart failure): "failure" is its own word; "kidney" is another chapter's
    # (N18.9); "diabetes" another chapter's (E11.9); "heart" would be own too
    assert classes["failure"] == "own_description"
    assert classes["kidney"] == "other_description" and classes["diabetes"] == "other_description"
    assert classes[","] == "punctuation" and classes["N18.9"] == "code"
    assert classes["the"] == "prose" and classes["shows"] == "prose"
    # for an emitted I10, I50.9's and I25.10's words are the same chapter's
    as_i10 = dict(zip(pieces, classify_tokens(text, offsets, range(len(offsets)), "I10", words, spans)))
    assert as_i10["failure"] == "chapter_description"
    shares = class_shares(list(classes.values()))
    assert abs(sum(shares.values()) - 1.0) < 1e-12 and shares["prose"] > 0


def test_previous_code_end_is_the_last_token_of_the_code_just_before():
    trace = "first I10 then N18.9 and finally I50.9"
    prompt = "PROMPT: "
    full = prompt + trace
    offsets = _words_tokenize(full)
    mentions = [(m.group(0), m.start(), m.end()) for m in re.finditer(r"I10|N18\.9|I50\.9", trace)]
    spans = mention_token_spans(offsets, mentions, len(prompt))
    for code, first, last in spans:
        assert full[offsets[first][0]:offsets[last][1]].strip() == code
    (_, f0, l0), (_, f1, l1), (_, f2, _) = spans
    assert previous_code_end(spans, f0) is None
    assert previous_code_end(spans, f1) == l0
    assert previous_code_end(spans, f2) == l1
