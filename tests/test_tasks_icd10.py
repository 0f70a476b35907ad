"""ICD-10-CM as a task adapter: the same events as the extractor gave before the interface."""

from __future__ import annotations

import hashlib
import json
from collections import Counter

from mistill.instrument.events import extract_events, realize_events
from mistill.tasks import task
from mistill.tasks.icd10 import ICD10Task

CODES = ["N18.1", "N18.9", "N18.30", "N17.9", "E11.9", "E11.65", "I10", "J18.9"]
BODY = ("Consider N18.9, then E11.65 and I10; maybe J18.9. Options N18.1 and N18.9. Not N18.1. "
        "Keep N18.9, really N18.9. N18.30 or N18.91? " + " ".join(f"w{i}" for i in range(40)))
TRACE = f"<think>\n{BODY}\n</think>\n\n[\"N18.9\", \"E11.65\"]"
# sha256 of the events the extractor wrote for TRACE before the task interface existed
PINNED = "6a57d1e0cb00fc6efa05374bd1977ac8080469d88230d4f685ba791065c3dd47"


def digest(events) -> str:
    return hashlib.sha256(json.dumps([e.to_dict() for e in events], sort_keys=True).encode()).hexdigest()


def test_same_events_as_before_the_interface():
    default = extract_events("icd", TRACE, CODES, n_null=6, seed=2)
    explicit = extract_events("icd", TRACE, CODES, n_null=6, seed=2, task=task("icd10"))
    assert default == explicit
    assert digest(default) == PINNED
    assert Counter(e.kind for e in default) == {"P2": 7, "P1": 6, "P2C": 6, "NULL": 6}


def test_adapter_rules():
    t = ICD10Task({"N18.9": "Chronic kidney disease, unspecified", "N18.1": "Chronic kidney disease, stage 1",
                   "E11.9": "Type 2 diabetes mellitus without complications"})
    assert t.has_p1 and t.p1_target("N18.9") == "N" and t.unscored_chars == {"."}
    assert t.related("N18.9", "N18.1") and not t.related("N18.9", "N17.9")
    assert t.null_choices(CODES) == ("E", "I", "J", "N")
    assert t.normalise_items(["N189", "I10"]) == ("I10", "N18.9")
    spans = t.item_like_spans("see N18.9 and Z99.89 here", ["N18.9"])
    assert spans == [(4, 9), (14, 20)]  # an inventory mention and a code-shaped run
    gen = '<think>N18.9?</think>\n["N18.9", "X00", "E11.9", "N18.9"]'
    assert t.parse_answer(gen) == ("N18.9", "E11.9")
    assert t.parse_answer("<think>unclosed [\"N18.9\"]") == ()
    m = t.metric(["N18.9", "N18.1"], t.parse_answer(gen))
    assert (m["tp"], m["fp"], m["fn"], m["f1"]) == (1.0, 1.0, 1.0, 0.5) and m["p_at_8"] == 1 / 8


def test_realization_with_the_adapter_matches_the_default():
    from tok_fixtures import merging_tokenizer

    tok = merging_tokenizer()
    events = extract_events("icd", TRACE, CODES, n_null=6, seed=2, tokenizer=tok)
    a = realize_events(events, full_text="P: " + TRACE, trace_offset=3, tokenizer=tok, codes=CODES)
    b = realize_events(events, full_text="P: " + TRACE, trace_offset=3, tokenizer=tok, codes=CODES,
                       task=ICD10Task())
    assert a == b and {r.event.kind for r in a} >= {"P1", "P2C", "NULL"}
