"""The privacy guard on its own (no server): detection, file types, speed, no false positives."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from mistill.errors import MistillInputError
from mistill.tracking.privacy import PrivacyError, PrivacyGuard, ngram_hashes, tokens

CANARY = "the zebra canary walked slowly past the violet lighthouse at dawn"
NOTE = ("Discharge summary. Patient is a 67 year old man admitted with dyspnea. "
        f"History notable for {CANARY}. He was treated with diuretics and improved.")


def restricted(**kw) -> PrivacyGuard:
    return PrivacyGuard([NOTE], "restricted", **kw)


def test_levels_and_allows_text() -> None:
    assert PrivacyGuard([NOTE], "synthetic").allows_text
    assert PrivacyGuard([NOTE], "public").allows_text
    assert not restricted().allows_text
    with pytest.raises(MistillInputError):
        PrivacyGuard([NOTE], "secret")
    assert issubclass(PrivacyError, MistillInputError)


def test_ngram_hash_is_positional_and_tokens_normalise() -> None:
    assert tokens("The  Zebra,\n\tcanary\\nWALKED") == ["the", "zebra", "canary", "walked"]
    words = "a b c d e f g".split()
    h = ngram_hashes(words)
    assert h.shape == (2,) and h.dtype == np.uint64 and h[0] != h[1]
    assert ngram_hashes(words[:5]).size == 0
    assert ngram_hashes(list(reversed(words)))[0] not in set(h.tolist())


def test_restricted_refuses_canary_everywhere_and_names_where() -> None:
    g = restricted()
    # re-wrapped, re-cased, with punctuation and JSON escapes: still caught
    variants = [CANARY, CANARY.upper(), CANARY.replace(" ", "\n  "),
                "x: " + CANARY.replace(" ", ", ") + " ...", json.dumps({"t": CANARY.replace(" the ", "\nthe ")})]
    for v in variants:
        with pytest.raises(PrivacyError, match="refusing to log param p"):
            g.check_text(v, "param p")
    with pytest.raises(PrivacyError) as err:
        g.check_mapping({"prompt": "x " + CANARY}, "param")
    assert "param prompt" in str(err.value) and "zebra" not in str(err.value)
    with pytest.raises(PrivacyError, match="tag name"):  # the key itself is not repeated
        g.check_mapping({CANARY: "1"}, "tag")
    with pytest.raises(PrivacyError):  # words split over list items
        g.check_mapping({"tokens": CANARY.split()}, "param")
    # fewer than six shared words is not a leak
    g.check_text("the zebra canary walked slowly", "param p")


def test_synthetic_allows_everything(tmp_path: Path) -> None:
    g = PrivacyGuard([NOTE], "synthetic")
    g.check_text(NOTE, "param p")
    g.check_mapping({CANARY: CANARY}, "tag")
    f = tmp_path / "x.bin"
    f.write_bytes(b"\x00\x01" + CANARY.encode())
    g.check_file(f)
    g.check_dataframe(pd.DataFrame({"text": [NOTE]}), "dataset d")


def test_short_protected_texts() -> None:
    g = PrivacyGuard(["Mrs Eleanor Vantablack", "ok no", "short"], "restricted")
    with pytest.raises(PrivacyError):
        g.check_text("seen by mrs  eleanor VANTABLACK today", "tag who")
    g.check_text("mrs eleanor vantablacks", "tag who")  # whole words only
    g.check_text("ok no short", "tag who")  # under 16 characters: not protected


def test_files(tmp_path: Path) -> None:
    g = restricted()
    leak_json = tmp_path / "events.json"
    leak_json.write_text(json.dumps({"context": CANARY}, indent=2))
    leak_tokens = tmp_path / "toks.json"
    leak_tokens.write_text(json.dumps([" " + w for w in CANARY.split()]))  # BPE-like pieces
    leak_csv = tmp_path / "t.csv"
    pd.DataFrame({"id": ["n1"], "snippet": [CANARY]}).to_csv(leak_csv, index=False)
    leak_html = tmp_path / "f.html"
    leak_html.write_text("<p>" + CANARY.replace(" ", "&nbsp;") + "</p>")
    leak_npy = tmp_path / "s.npy"
    np.save(leak_npy, np.array(CANARY.split()))
    unknown_bin = tmp_path / "fig.png"
    unknown_bin.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    for p in (leak_json, leak_tokens, leak_csv, leak_html, leak_npy, unknown_bin):
        with pytest.raises(PrivacyError, match="artifact"):
            g.check_file(p)

    ok_npz = tmp_path / "w.npz"
    np.savez(ok_npz, w=np.random.default_rng(0).normal(size=(30, 9)))
    ok_pt = tmp_path / "w.pt"
    ok_pt.write_bytes(b"\x80\x02binary torch pickle \x00\x01" + CANARY.encode())  # unscanned
    ok_py = tmp_path / "x.py"
    ok_py.write_text("def f(x):\n    return x + 1\n")  # unknown text type: scanned, clean
    for p in (ok_npz, ok_pt, ok_py):
        g.check_file(p)
    with pytest.raises(PrivacyError):
        g.check_dir(tmp_path)


def test_no_false_positive_on_code_and_numbers(tmp_path: Path) -> None:
    g = restricted()
    rng = np.random.default_rng(1)
    table = pd.DataFrame({"head": [f"L{i // 9}H{i % 9}" for i in range(270)],
                          "importance": rng.normal(size=270), "rank": np.arange(270)})
    table.to_csv(tmp_path / "heads.csv", index=False)
    (tmp_path / "metrics.json").write_text(json.dumps({"micro_f1": 0.41, "codes": ["N18.9", "E11.9"]}))
    import mistill.io

    (tmp_path / "code.py").write_text(Path(mistill.io.__file__).read_text())
    g.check_dir(tmp_path)
    g.check_mapping({"lr": 1e-5, "model": "HuggingFaceTB/SmolLM2-135M-Instruct", "k": 40}, "param")
    g.check_dataframe(pd.DataFrame({"note_id": ["n1", "n2"], "split": ["test", "test"]}), "dataset d")


def test_public_texts_are_not_protected() -> None:
    desc = "chronic kidney disease stage 3 unspecified with anemia"
    g = PrivacyGuard([f"Assessment: {desc}. {CANARY}."], "restricted", public_texts=[desc])
    g.check_text(f"N18.30 {desc}", "artifact inventory.csv")
    with pytest.raises(PrivacyError):
        g.check_text(CANARY, "param p")


def test_dataframe_text_columns() -> None:
    g = restricted()
    with pytest.raises(PrivacyError, match="column 'text'"):
        g.check_dataframe(pd.DataFrame({"note_id": ["n1"], "text": [CANARY]}), "dataset d")
    with pytest.raises(PrivacyError, match="free-text"):  # unprotected but free text
        g.check_dataframe(pd.DataFrame({"t": [" ".join(["word"] * 20)]}), "dataset d")


def test_fast_on_hundreds_of_long_notes() -> None:
    rng = random.Random(0)
    vocab = [f"word{i}" for i in range(5000)]  # (w12-like tokens would read as label codes)
    notes = [" ".join(rng.choice(vocab) for _ in range(3000)) for _ in range(300)]
    t0 = time.perf_counter()
    g = PrivacyGuard(notes, "restricted")
    built = time.perf_counter() - t0
    assert g.n_protected_ngrams > 850_000
    probe = " ".join(notes[123].split()[1000:1006])
    other = " ".join(rng.choice(vocab) for _ in range(200_000))
    t0 = time.perf_counter()
    with pytest.raises(PrivacyError):
        g.check_text("prefix " + probe + " suffix", "artifact a")
    g.check_text(other, "artifact b")  # 200k random words: no 6-gram in common
    checked = time.perf_counter() - t0
    assert built < 5.0 and checked < 2.0, (built, checked)


def test_label_codes_and_descriptions_are_public() -> None:
    trace = ("The findings point to N18.9 and E11.65, then I10 and J18.9 and K58.1 and A68.9. "
             "Patient reported worsening shortness of breath after climbing two flights of stairs.")
    g = PrivacyGuard([trace], "restricted",
                     public_texts=["Chronic kidney disease, unspecified", "Type 2 diabetes mellitus with hyperglycemia"])
    # a list of gold codes in the trace's order shares no n-gram: codes split the text
    g.check_text("N18.9 E11.65 I10 J18.9 K58.1 A68.9", "tag gold codes")
    # the free prose around them is still protected, across a code too
    with pytest.raises(PrivacyError):
        g.check_text("reported worsening shortness of breath after climbing", "artifact x")
    import pandas as pd

    g.check_dataframe(pd.DataFrame({"gold_codes": ["N18.9 E11.65 I10 J18.9 K58.1 A68.9 Z14.1 C68.9 F42.9"]}),
                      "dataset index")
    notes_quote = "Assessment: type 2 diabetes mellitus with hyperglycemia noted on the second day."
    g2 = PrivacyGuard([notes_quote], "restricted", public_texts=["Type 2 diabetes mellitus with hyperglycemia"])
    g2.check_text('{"E11.65": "Type 2 diabetes mellitus with hyperglycemia"}', "artifact inventory.json")
