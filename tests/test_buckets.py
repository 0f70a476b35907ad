"""Span buckets: the axis partitions the untemplated text, two real tokenizers share it and map
every token to the bucket holding its text, carve-outs at a P2C row, bucketize, region buckets."""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch

from mistill.data.prompts import build_prompt
from mistill.data.synthetic import make_synthetic_corpus
from mistill.distill.buckets import (CARVED, BucketAxis, build_axis, bucketize, region_buckets,
                                     row_buckets, token_buckets, trace_pieces)
from mistill.errors import MistillInputError
from mistill.instrument.events import extract_events, realize_events


@pytest.fixture(scope="module")
def corpus():
    return make_synthetic_corpus(n_notes=2, seed=0)


@pytest.fixture(scope="module")
def note(corpus):
    return corpus.notes[0]


@pytest.fixture(scope="module")
def smol():
    from mistill.models.loading import embedded_tokenizer

    return embedded_tokenizer()


@pytest.fixture(scope="module")
def wordy(smol):
    """A second real fast tokenizer: letter runs, single digits and single symbols, each with
    its leading whitespace (so many tokens start with a blank that belongs to the previous
    bucket), SmolLM2's special tokens and its chat template."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(
        Regex(r"\s*[A-Za-z]+|\s*[0-9]|\s*[^\sA-Za-z0-9]|\s+"), behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    fast.chat_template = smol.chat_template
    return fast


def encode(tokenizer, text):
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return enc["input_ids"], [tuple(o) for o in enc["offset_mapping"]]


def reference_buckets(axis: BucketAxis, prompt, trace, offsets):
    """Bucket of every token, by direct reading of the rule (one token at a time)."""
    full = prompt.full_text(trace)
    L = len(prompt.user_text)
    base = list(range(1, axis.n_base))
    out = []
    for i, (s, e) in enumerate(offsets):
        if i == 0 or e <= s:
            out.append(0)
            continue
        piece = full[s:e]
        lead = len(piece) - len(piece.lstrip())
        t = s + (lead if lead < len(piece) else 0)
        if prompt.user_offset <= t < prompt.user_offset + L:
            u = t - prompt.user_offset
        elif prompt.trace_offset <= t < prompt.trace_offset + len(trace):
            u = L + t - prompt.trace_offset
        else:
            out.append(0)
            continue
        hits = [b for b in base if axis.spans[b][0] <= u < axis.spans[b][1]]
        assert len(hits) == 1
        out.append(hits[0])
    return out


# --------------------------------------------------------------------------------------------
# The axis
# --------------------------------------------------------------------------------------------

def test_trace_pieces_by_hand():
    t = "One. Two?\nThree\n\nFour! Five e.g.x six"
    pieces = [t[a:b] for a, b in trace_pieces(t)]
    assert pieces == ["One. ", "Two?\n", "Three\n\n", "Four! ", "Five e.g.x six"]
    s = "aaaa bbbb cccc dddd"
    assert trace_pieces(s, cap=12) == [(0, 10), (10, 19)]  # cut at the last word start <= 12
    assert trace_pieces("x" * 30, cap=12) == [(0, 12), (12, 24), (24, 30)]  # one long word
    assert trace_pieces("word " * 100) == [(0, 400), (400, 500)]
    assert trace_pieces("") == []


def test_axis_partitions_untemplated_text(note, corpus):
    inv = corpus.inventory
    shortlist = list(note.gold_codes) + [c for g in note.gold_codes for c in inv.siblings(g)]
    for codes in (None, shortlist):
        prompt = build_prompt(note, codes, inv, tokenizer=None)
        trace = note.teacher_trace
        axis = build_axis(prompt, trace)
        text = prompt.user_text + trace
        assert axis.text_len == len(text) and axis.user_len == len(prompt.user_text)
        assert axis.names[0] == "template" and axis.spans[0] == (-1, -1)
        assert axis.names[-5:] == CARVED and axis.kinds[-5:] == ("carved",) * 5
        assert all(sp == (-1, -1) for sp in axis.spans[-5:])
        base = axis.spans[1:axis.n_base]
        assert base[0][0] == 0 and base[-1][1] == len(text)
        assert all(a < b for a, b in base)
        assert all(base[i][1] == base[i + 1][0] for i in range(len(base) - 1))
        assert "".join(text[a:b] for a, b in base) == text
        # every character lies in exactly one base bucket
        hits = Counter(u for a, b in base for u in range(a, b))
        assert len(hits) == len(text) and set(hits.values()) == {1}
        # kinds in layout order, one line per candidate, in prompt order
        order = ["header", "line", "summary_header", "note", "instruction", "trace"]
        ks = [k for k in axis.kinds[1:axis.n_base]]
        assert [k for i, k in enumerate(ks) if i == 0 or k != ks[i - 1]] == order
        lines = axis.of_kind("line")
        assert [axis.line_codes[b] for b in lines] == list(prompt.codes)
        for b in lines:
            c = axis.line_codes[b]
            a, e = axis.spans[b]
            assert a == prompt.line_spans[c][0]
            assert text[a:e] == inv.line(c) + ("\n\n" if c == prompt.codes[-1] else "\n")
        # note windows: 32 words each (the last fewer), covering note and the blank line after
        windows = [text[a:b] for a, b in (axis.spans[i] for i in axis.of_kind("note"))]
        counts = [len(w.split()) for w in windows]
        assert all(n == 32 for n in counts[:-1]) and 1 <= counts[-1] <= 32
        assert "".join(windows) == prompt.part("note") + "\n\n"
        assert text[slice(*axis.spans[axis.index("instruction")])] == prompt.part("instruction")
        # trace pieces: at most 400 characters, no sentence boundary inside a piece
        pieces = [text[a:b] for a, b in (axis.spans[i] for i in axis.of_kind("trace"))]
        assert "".join(pieces) == trace and len(pieces) > 10
        assert all(len(p) <= 400 for p in pieces)
        assert not any(re.search(r"[.?!]\s+\S|\n\s*\S", p) for p in pieces)
        assert axis.n == 1 + len(base) + 5


# --------------------------------------------------------------------------------------------
# Tokens -> buckets with two real tokenizers
# --------------------------------------------------------------------------------------------

def test_two_tokenizers_one_axis_every_token_in_its_bucket(note, corpus, smol, wordy):
    inv, trace = corpus.inventory, note.teacher_trace
    p_smol = build_prompt(note, None, inv, smol)
    p_word = build_prompt(note, None, inv, wordy)
    p_plain = build_prompt(note, None, inv, tokenizer=None)
    axis = build_axis(p_smol, trace)
    assert build_axis(p_word, trace) == axis == build_axis(p_plain, trace)
    assert p_smol.text == p_word.text and p_smol.user_offset > 0

    maps = {}
    for name, tok, prompt in (("smol", smol, p_smol), ("word", wordy, p_word),
                              ("smol-plain", smol, p_plain)):
        ids, offs = encode(tok, prompt.full_text(trace))
        got = token_buckets(axis, prompt, offs, len(trace))
        assert got.dtype == torch.long and got.shape == (len(ids),)
        assert got.tolist() == reference_buckets(axis, prompt, trace, offs), name
        maps[name] = (got, offs, prompt)
        # every base bucket receives tokens; carved slots receive none
        assert set(got.tolist()) == set(range(axis.n_base))
    assert len(maps["smol"][0]) != len(maps["word"][0])  # genuinely different tokenizations

    got, offs, prompt = maps["smol"]
    full = prompt.full_text(trace)
    texts = [full[s:e] for s, e in offs]
    # template tokens (special tokens, the role names, the system turn) sit in bucket 0
    for i, t in enumerate(texts):
        if t in ("<|im_start|>", "<|im_end|>"):
            assert got[i] == 0
    assert got[0] == 0
    # the text of a bucket's tokens, blanks aside, is the bucket's text
    for b in (axis.index("header"), axis.line_bucket(prompt.codes[5]), axis.index("trace:3")):
        a, e = axis.spans[b]
        joined = "".join(texts[i] for i in range(len(texts)) if got[i] == b)
        assert joined.split() == (prompt.user_text + trace)[a:e].split()
    # in the word tokenizer, a token " Next" opening a sentence goes to the new piece
    wgot, woffs, wprompt = maps["word"]
    wfull = wprompt.full_text(trace)
    b = axis.index("trace:4")
    start = wprompt.trace_offset + axis.spans[b][0] - axis.user_len
    i = next(i for i, (s, e) in enumerate(woffs) if s < start < e)
    assert wfull[woffs[i][0]:start].isspace() and wgot[i] == b and wgot[i - 1] == b - 1
    # the no-template text: position 0 is the sink even though it is header text
    pgot, poffs, _ = maps["smol-plain"]
    assert pgot[0] == 0 and pgot[1] == axis.index("header")


def test_token_buckets_reject_a_foreign_axis(note, corpus, smol):
    prompt = build_prompt(note, None, corpus.inventory, smol)
    axis = build_axis(prompt, note.teacher_trace)
    other = corpus.notes[1].teacher_trace
    _, offs = encode(smol, prompt.full_text(other))
    with pytest.raises(MistillInputError) as exc:
        token_buckets(axis, prompt, offs, len(other))
    assert exc.value.field == "axis" and exc.value.note == note.note_id
    # empty offsets (an added special token) go to bucket 0
    _, offs = encode(smol, prompt.full_text(note.teacher_trace))
    offs = [(0, 0)] + offs[1:5] + [(0, 0)] + offs[6:]
    got = token_buckets(axis, prompt, offs, len(note.teacher_trace))
    assert got[5] == 0


# --------------------------------------------------------------------------------------------
# Carve-outs and region buckets
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def realized(note, corpus, smol):
    inv, trace = corpus.inventory, note.teacher_trace
    prompt = build_prompt(note, None, inv, smol)
    full = prompt.full_text(trace)
    ids, offs = encode(smol, full)
    events = extract_events(note.note_id, trace, inv.codes, n_null=0)
    rel = realize_events(events, full_text=full, trace_offset=prompt.trace_offset,
                         tokenizer=smol, input_ids=ids, offsets=offs, codes=inv.codes)
    axis = build_axis(prompt, trace)
    base = token_buckets(axis, prompt, offs, len(trace))
    return prompt, full, offs, rel, axis, base


def test_carve_outs_at_a_p2c_row(realized, corpus):
    prompt, full, offs, rel, axis, base = realized
    inv = corpus.inventory
    r = next(r for r in rel if r.event.kind == "P2C" and r.event.S and r.event.N)
    ev = r.event
    got = row_buckets(axis, base, r, prompt, inv, offs)
    assert got.shape == base.shape and not torch.equal(got, base)
    slot = {name: axis.slot(name) for name in CARVED}
    where = {name: [i for i in range(len(got)) if got[i] == s] for name, s in slot.items()}
    own = axis.line_bucket(ev.code)
    sibs = [axis.line_bucket(c) for c in inv.siblings(ev.code)]
    assert ev.near_miss in inv.siblings(ev.code) and all(b is not None for b in sibs)
    assert where["own_line"] == [i for i in range(len(base)) if base[i] == own]
    assert where["siblings"] == [i for i in range(len(base)) if int(base[i]) in sibs]
    assert where["S"] == list(r.S_positions) and where["N"] == list(r.N_positions)
    assert where["prefix"] == list(r.prefix_positions) and where["prefix"][-1] == r.position
    # by text: the own line with its newline, the sibling lines, the code, the near-miss
    text = lambda idx: "".join(full[offs[i][0]:offs[i][1]] for i in idx)  # noqa: E731
    assert text(where["own_line"]) == inv.line(ev.code) + "\n"
    assert sorted(text(where["siblings"]).strip().split("\n")) == \
        sorted(inv.line(c) for c in inv.siblings(ev.code))
    assert text(where["S"]).split() == [ev.code] * len(ev.S)
    assert text(where["N"]).split() == [ev.near_miss] * len(ev.N)
    assert text(where["prefix"]).strip() == ev.code[:ev.char_index]
    # every other token keeps its base bucket
    carved = {i for idx in where.values() for i in idx}
    assert all(got[i] == base[i] for i in range(len(base)) if i not in carved)
    assert base.max() < axis.n_base  # base maps never use the slots
    # a P1 row keeps the base map
    p1 = next(r for r in rel if r.event.kind == "P1")
    assert torch.equal(row_buckets(axis, base, p1, prompt, inv, offs), base)


def test_region_buckets(realized):
    prompt, _, _, rel, axis, _ = realized
    p1 = [r for r in rel if r.event.kind == "P1"]
    assert len({r.event.target for r in p1}) >= 3
    for r in p1:
        got = region_buckets(axis, r)
        want = [axis.line_bucket(c) for c in prompt.codes if c[0] == r.event.target]
        assert got == sorted(want) and got
        assert all(axis.names[b] == f"line:{axis.line_codes[b]}" for b in got)
        assert all(axis.line_codes[b].startswith(r.event.code[0]) for b in got)
    p2c = next(r for r in rel if r.event.kind == "P2C")
    assert region_buckets(axis, p2c.event) == [axis.slot("own_line"), axis.slot("siblings")]
    null = type(p2c.event)(event_id="x:NULL:0", note_id="x", kind="NULL", anchor=0,
                           target="A", competitors=("B",))
    with pytest.raises(MistillInputError):
        region_buckets(axis, null)


# --------------------------------------------------------------------------------------------
# bucketize
# --------------------------------------------------------------------------------------------

def test_bucketize_by_hand_and_differentiable():
    attn = torch.tensor([0.1, 0.2, 0.3, 0.4], requires_grad=True)
    buckets = torch.tensor([0, 2, 0, 1, 1, 2])  # longer than the row: the prefix is used
    out = bucketize(attn, buckets, 4)
    assert torch.allclose(out, torch.tensor([0.4, 0.4, 0.2, 0.0]))
    out[0].backward()
    assert attn.grad.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert bucketize(attn.detach().bfloat16(), buckets, 4).dtype == torch.float32


def test_bucketize_rows_sum_to_one(realized):
    *_, axis, base = realized
    gen = torch.Generator().manual_seed(0)
    n_pos = base.numel()
    for q in (1, 17, n_pos // 2, n_pos):
        attn = torch.softmax(torch.randn(3, 5, q, generator=gen) * 4, dim=-1)
        out = bucketize(attn, base, axis.n)
        assert out.shape == (3, 5, axis.n)
        assert torch.allclose(out.sum(-1), torch.ones(3, 5), atol=1e-5)
        assert (out >= 0).all() and (out[..., axis.n_base:] == 0).all()
    # per-row maps broadcast against heads: [row, 1, pos] with [row, head, pos]
    maps = torch.randint(0, 7, (2, 1, 50), generator=gen)
    attn = torch.softmax(torch.randn(2, 4, 50, generator=gen), dim=-1)
    out = bucketize(attn, maps, 7)
    assert torch.allclose(out.sum(-1), torch.ones(2, 4), atol=1e-6)
    for r in range(2):
        for b in range(7):
            assert torch.allclose(out[r, :, b], attn[r][:, maps[r, 0] == b].sum(-1), atol=1e-6)
