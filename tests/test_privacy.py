"""The privacy guard on its own (no server): detection, disguises, file types, speed, no false
positives."""

from __future__ import annotations

import argparse
import base64
import json
import random
import struct
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from mistill.errors import MistillInputError
from mistill.tracking.privacy import (CHAR_WINDOW, MAX_DECODE_ROUNDS, PrivacyError, PrivacyGuard, decode_escapes,
                                      ngram_hashes, normalise, tokens)
from tok_fixtures import bpe_tokenizer

CANARY = "the zebra canary walked slowly past the violet lighthouse at dawn"
NOTE = ("Discharge summary. Patient is a 67 year old man admitted with dyspnea. "
        f"History notable for {CANARY}. He was treated with diuretics and improved.")
WORDS = CANARY.split()
SIX = WORDS[:6]  # "the zebra canary walked slowly past": 6 words, 30 letters


def restricted(**kw) -> PrivacyGuard:
    return PrivacyGuard([NOTE], "restricted", **kw)


def test_levels_and_allows_text() -> None:
    assert PrivacyGuard([NOTE], "synthetic").allows_text
    assert PrivacyGuard([NOTE], "public").allows_text
    assert not restricted().allows_text
    with pytest.raises(MistillInputError):
        PrivacyGuard([NOTE], "secret")
    assert issubclass(PrivacyError, MistillInputError)


def test_url_escapes_decode_as_unquote_decodes_them() -> None:
    """Only runs of %XX escapes are decoded (each as one UTF-8 byte string, invalid bytes as
    U+FFFD), every other '%' kept: repeated ``urllib.parse.unquote``, on random texts of escapes,
    broken escapes, bare percents and other characters."""
    def reference(text: str) -> str:
        for _ in range(MAX_DECODE_ROUNDS):
            out = urllib.parse.unquote(text)
            if out == text:
                break
            text = out
        return text

    pieces = ["%", "%2", "%20", "%C3", "%A9", "%c3%a9", "%E2%82", "%AC", "%zz", "a", "é", "x%", "%%",
              "%F0%9F%98", "%80", " ", "%4", "1", "%25", "%2541"]
    rng = random.Random(0)
    for _ in range(20000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(14)))
        assert decode_escapes(text) == reference(text), text
    assert decode_escapes("100%% of %7A%65bra") == "100%% of zebra"
    assert decode_escapes("%2541") == "A"  # %25 -> '%', then %41 -> 'A' on the next round


def test_ngram_hash_is_positional_and_tokens_normalise() -> None:
    assert tokens("The  Zebra,\n\tcanary\\nWALKED") == ["the", "zebra", "canary", "walked"]
    # separators the old \w+ tokeniser kept inside words, camelCase, lookalikes, escapes
    assert tokens("the_zebra-canary.walked/slowly+past") == SIX
    assert tokens("theZebraCanary HTMLParser") == ["the", "zebra", "canary", "html", "parser"]
    assert tokens("thе%20zеbrа") == ["the", "zebra"]  # Cyrillic е and а, URL-encoded space
    assert normalise("ＴＨＥ t\u200bhe café") == "the the cafe"
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


# ------------------------------------------------------------------------------ disguises
_CYRILLIC = str.maketrans("aeopcxyi", "аеорсхуі")
_GREEK = str.maketrans("aoipkx", "αοιρκχ")


def _bold(text: str) -> str:
    """Mathematical bold small letters (U+1D41A..): NFKC folds them to ASCII."""
    return "".join(chr(0x1D41A + ord(c) - ord("a")) if "a" <= c <= "z" else c for c in text)


def _fullwidth(text: str) -> str:
    return "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else "\u3000" for c in text)


def _camel(words: list[str]) -> str:
    return words[0] + "".join(w.capitalize() for w in words[1:])


DISGUISES: dict[str, Callable[[list[str]], str]] = {
    "underscore": "_".join,
    "hyphen": "-".join,
    "dot": ".".join,
    "slash": "/".join,
    "snake-upper": lambda w: "_".join(w).upper(),
    "camelCase": _camel,
    "PascalCase": lambda w: "".join(x.capitalize() for x in w),
    "zwsp-between": "\u200b".join,
    "zwnj-between": "\u200c".join,
    "zwj-between": "\u200d".join,
    "word-joiner-between": "\u2060".join,
    "bom-between": "\ufeff".join,
    "zwsp-inside-words": lambda w: " ".join("\u200b".join(x) for x in w),
    "soft-hyphen-inside-words": lambda w: " ".join("\u00ad".join(x) for x in w),
    "nul-inside-words": lambda w: " ".join("\x00".join(x) for x in w),
    "hangul-filler-between": "\u3164".join,
    "full-width": lambda w: _fullwidth(" ".join(w)),
    "math-bold": lambda w: _bold(" ".join(w)),
    "combining-accents": lambda w: " ".join("".join(c + "\u0301" for c in x) for x in w),
    "cyrillic-homoglyphs": lambda w: " ".join(w).translate(_CYRILLIC),
    "greek-homoglyphs": lambda w: " ".join(w).translate(_GREEK),
    "url-encoded": lambda w: urllib.parse.quote(" ".join(w)),
    "url-plus": lambda w: urllib.parse.quote_plus(" ".join(w)),
    "url-double-encoded": lambda w: urllib.parse.quote(urllib.parse.quote(" ".join(w))),
    "html-nbsp": "&nbsp;".join,
    "html-numeric-entities": lambda w: "".join(f"&#{ord(c)};" for c in " ".join(w)),
    "json-surrogate-pairs": lambda w: json.dumps(_bold(" ".join(w))),
    "camel-cyrillic-url": lambda w: urllib.parse.quote(_camel(w).translate(_CYRILLIC)),
    "reversed": lambda w: " ".join(w)[::-1],
    "doubled-words": lambda w: " ".join(f"{x} {x}" for x in w),
    "leetspeak": lambda w: " ".join(w).translate(str.maketrans("aeiost", "431057")),
    "base64": lambda w: base64.b64encode(" ".join(w).encode()).decode(),
    "base64-urlsafe-unpadded": lambda w: base64.urlsafe_b64encode(("~" + " ".join(w)).encode()).decode().rstrip("="),
    "base64-twice": lambda w: base64.b64encode(base64.b64encode(" ".join(w).encode())).decode(),
}


@pytest.mark.parametrize("words", [WORDS, SIX], ids=["12-words", "6-words"])
@pytest.mark.parametrize("name", list(DISGUISES))
def test_disguised_sentence_is_refused_on_every_route(name: str, words: list[str], tmp_path: Path) -> None:
    """A disguised protected sentence is refused as a param, in a nested mapping, and in every
    file type that can carry a string: JSON, a torch pickle, safetensors metadata."""
    from safetensors.torch import save_file

    g = PrivacyGuard([NOTE], "restricted")
    text = f"context: {DISGUISES[name](words)} (end)"
    with pytest.raises(PrivacyError, match="param p"):
        g.check_text(text, "param p")
    with pytest.raises(PrivacyError):
        g.check_mapping({"k": {"nested": [text]}}, "param")
    (tmp_path / "a.json").write_text(json.dumps({"v": text}))
    torch.save({"v": text, "w": torch.zeros(2)}, tmp_path / "a.pt")
    save_file({"w": torch.zeros(2)}, tmp_path / "a.safetensors", metadata={"v": text})
    for f in ("a.json", "a.pt", "a.safetensors"):
        with pytest.raises(PrivacyError, match=f):
            g.check_file(tmp_path / f)
    PrivacyGuard([NOTE], "synthetic").check_dir(tmp_path)


def test_glued_letters_from_forty_on() -> None:
    """Words glued with no separator, or letters spaced out: refused once 40 letters of a
    protected text are in a row."""
    g = restricted()
    glued = "".join(WORDS)  # 53 letters
    assert len(glued) >= CHAR_WINDOW > len("".join(SIX))
    for text in (glued, glued.upper(), f"id={glued}&x=1", " ".join(glued), "-".join(glued.upper()),
                 "the" + "".join(WORDS[1:]).translate(_CYRILLIC)):
        with pytest.raises(PrivacyError):
            g.check_text(text, "tag t")
    g.check_text("".join(SIX), "tag t")  # 30 letters: below the window, the documented limit
    g.check_text(glued[:CHAR_WINDOW - 1], "tag t")


def test_camel_case_inside_a_note_is_found_recased() -> None:
    """A note's own camelCase words (mmHg, McDonald) are indexed split and unsplit."""
    g = PrivacyGuard(["On the ward his blood pressure was taken in mmHg by the McDonald team."],
                     "restricted")
    for text in ("pressure was taken in mmHg by", "PRESSURE WAS TAKEN IN MMHG BY",
                 "pressure_was_taken_in_mm_hg", "pressureWasTakenInMmHgBy", "in mmhg by the mcdonald team",
                 "IN_MM_HG_BY_THE_MC_DONALD_TEAM"):
        with pytest.raises(PrivacyError):
            g.check_text(text, "param p")


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
    with pytest.raises(PrivacyError):
        g.check_text("seen_by_mrs_eleanor_vantablack", "tag who")
    g.check_text("mrs eleanor vantablacks", "tag who")  # whole words only
    g.check_text("ok no short", "tag who")  # under 16 characters: not protected


# ------------------------------------------------------------------------------------ files
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
    fake_pt = tmp_path / "w.pt"  # not a torch file: cannot be read safely, so refused
    fake_pt.write_bytes(b"\x80\x02binary torch pickle \x00\x01" + CANARY.encode())
    for p in (leak_json, leak_tokens, leak_csv, leak_html, leak_npy, unknown_bin, fake_pt):
        with pytest.raises(PrivacyError, match="artifact"):
            g.check_file(p)

    ok = tmp_path / "ok"
    ok.mkdir()
    np.savez(ok / "w.npz", w=np.random.default_rng(0).normal(size=(30, 9)))
    torch.save({"w": torch.randn(3, 4), "step": 7}, ok / "w.pt")
    (ok / "x.py").write_text("def f(x):\n    return x + 1\n")  # unknown text type: scanned, clean
    g.check_dir(ok)
    with pytest.raises(PrivacyError):
        g.check_dir(tmp_path)


def test_markup_files_scanned_without_their_tags(tmp_path: Path) -> None:
    g = restricted()
    split = tmp_path / "split.html"  # every word in its own element: no 6-gram in the raw text
    split.write_text("<div>" + "".join(f"<span class='w'>{w}</span>" for w in SIX) + "</div>")
    alt = tmp_path / "alt.svg"  # text in an attribute
    alt.write_text(f'<svg><image href="x.png"><title>{" ".join(SIX)}</title></image>'
                   f'<text aria-label="{"_".join(WORDS)}">1</text></svg>')
    utf16 = tmp_path / "utf16.txt"
    utf16.write_bytes(CANARY.encode("utf-16"))
    for p in (split, alt, utf16):
        with pytest.raises(PrivacyError, match=p.name):
            g.check_file(p)
    fine = tmp_path / "fine.html"
    fine.write_text("<table>" + "".join(f"<tr><td>{w}</td><td>{i}</td></tr>" for i, w in enumerate(SIX)) + "</table>")
    g.check_file(fine)  # numbers between the words: no six in a row


def test_torch_pickles_are_loaded_safely_and_scanned(tmp_path: Path) -> None:
    g = restricted()
    note_pt = tmp_path / "state.pt"
    torch.save({"note": NOTE, "w": torch.zeros(2)}, note_pt)
    key_pth = tmp_path / "state.pth"  # text in dict keys and split over a tuple
    torch.save({"steps": ("x",) + tuple(f"{w}_" for w in WORDS), CANARY: 1}, key_pth)
    legacy = tmp_path / "legacy.bin"
    torch.save({"prompt": "_".join(WORDS)}, legacy, _use_new_zipfile_serialization=False)
    for p in (note_pt, key_pth, legacy):
        with pytest.raises(PrivacyError, match=f"artifact {p.name}: it contains protected"):
            g.check_file(p)

    opaque = tmp_path / "opaque.pt"  # an object the allow-list refuses: not unpickled, refused
    torch.save({"args": argparse.Namespace(lr=1e-3)}, opaque)
    with pytest.raises(PrivacyError, match="weights_only"):
        g.check_file(opaque)

    # numeric tensors, optimizer state, state dicts: allowed
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    torch.save({"ids": torch.tensor([[464, 1168, 13]], dtype=torch.int64), "names": ["layer.0", "layer.1"]},
               tmp_path / "ids.pth")
    for name in ("optimizer.pt", "pytorch_model.bin", "ids.pth"):
        g.check_file(tmp_path / name)


def test_safetensors_header_is_scanned(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    g = restricted()
    t = {"model.embed.weight": torch.zeros(4, 2)}
    save_file(t, tmp_path / "leak.safetensors", metadata={"format": "pt", "prompt": _camel(WORDS)})
    with pytest.raises(PrivacyError, match="leak.safetensors"):
        g.check_file(tmp_path / "leak.safetensors")
    save_file(t, tmp_path / "ok.safetensors", metadata={"format": "pt"})
    g.check_file(tmp_path / "ok.safetensors")
    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 8 + b"{}")
    with pytest.raises(PrivacyError, match="not a readable safetensors"):
        g.check_file(tmp_path / "bad.safetensors")


def test_numpy_strings_structured_and_object_arrays(tmp_path: Path) -> None:
    g = restricted()
    rec = np.zeros(len(SIX), dtype=[("word", "U16"), ("score", "f4")])
    rec["word"] = SIX
    np.save(tmp_path / "rec.npy", rec)
    np.savez(tmp_path / "obj.npz", a=np.array([CANARY, 1], dtype=object))
    np.savez(tmp_path / "pieces.npz", ids=np.arange(6), pieces=np.array([w[:2] for w in SIX] + [w[2:] for w in SIX]))
    with pytest.raises(PrivacyError, match="rec.npy"):
        g.check_file(tmp_path / "rec.npy")
    with pytest.raises(PrivacyError, match="object array"):
        g.check_file(tmp_path / "obj.npz")
    g.check_file(tmp_path / "pieces.npz")  # pieces out of order: no text
    np.savez(tmp_path / "num.npz", x=np.zeros((4, 4)), ids=np.arange(100))
    g.check_file(tmp_path / "num.npz")


@pytest.mark.parametrize("name", ["figure.png", "photo.jpg", "corpus.jsonl.gz", "table.parquet",
                                  "state.pkl", "blob"])
def test_unknown_binary_types_refused_for_restricted_only(tmp_path: Path, name: str) -> None:
    p = tmp_path / name
    p.write_bytes(b"\x89\x00\xff\xfe binary \x00\x01\x02" * 8)
    with pytest.raises(PrivacyError) as err:
        restricted().check_file(p)
    msg = str(err.value)
    assert f"artifact {name}" in msg and "cannot read" in msg and str(p) in msg
    assert ".safetensors" in msg and ".npz" in msg and ".json" in msg  # the readable types listed
    assert "contains protected" not in msg
    PrivacyGuard([NOTE], "synthetic").check_file(p)
    PrivacyGuard([NOTE], "public").check_file(p)


def _sentencepiece_model(pieces: list[tuple[str, float]]) -> bytes:
    """A sentencepiece ``ModelProto`` with only its pieces (field 1: piece, score)."""
    def field(tag: int, payload: bytes) -> bytes:
        n, size = len(payload), b""
        while True:
            size += bytes([(n & 0x7F) | (0x80 if n > 0x7F else 0)])
            n >>= 7
            if not n:
                break
        return bytes([tag]) + size + payload

    return b"".join(field(0x0A, field(0x0A, p.encode()) + b"\x15" + struct.pack("<f", s))
                    for p, s in pieces)


def test_platform_artifacts_pass_and_leaks_in_them_do_not(tmp_path: Path) -> None:
    """A trained model directory as the platform saves it (weights, config, tokenizer files,
    optimizer state) passes a restricted guard whose notes it does not hold -- although the
    tokenizer was trained on those very notes, so its vocabulary has every word of them."""
    from mistill.models.loading import tiny_model

    readme = Path(__file__).resolve().parents[1] / "README.md"
    tok, hf_tok = bpe_tokenizer([NOTE] * 20 + readme.read_text().splitlines())
    lm = tiny_model(layers=1, heads=2, kv_heads=1, d_model=16, d_head=8, tokenizer=hf_tok)
    out = tmp_path / "model"
    lm.model.save_pretrained(out)
    hf_tok.save_pretrained(out)
    tok.model.save(str(out))  # vocab.json, merges.txt
    vocab = json.loads((out / "vocab.json").read_text())
    assert {"zebra", "Ġzebra", "canary", "Ġcanary"} & set(vocab)
    (out / "tokenizer.model").write_bytes(_sentencepiece_model(
        [(p.replace("Ġ", "▁"), -float(i)) for p, i in sorted(vocab.items(), key=lambda kv: kv[1])]))
    opt = torch.optim.AdamW(lm.model.parameters())
    lm.model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    torch.save(opt.state_dict(), out / "optimizer.pt")
    torch.save({"step": 1, "lr": [1e-3]}, out / "scheduler.pt")
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "merges.txt", "vocab.json"} <= names
    g = restricted()
    g.check_dir(out)

    leaks = {"tokenizer.model": _sentencepiece_model([("▁" + w, 0.0) for w in WORDS]),
             "trainer_state.pt": None, "generation_config.json": json.dumps({"stopString": _camel(WORDS)})}
    for name, content in leaks.items():
        leak = tmp_path / "leak" / name
        leak.parent.mkdir(exist_ok=True)
        if content is None:
            torch.save({"last_prompt": NOTE, "step": 3}, leak)
        else:
            leak.write_bytes(content.encode() if isinstance(content, str) else content)
        with pytest.raises(PrivacyError, match=name):
            g.check_file(leak)


# ---------------------------------------------------------------------- no false positives
def test_no_false_positive_on_code_and_numbers(tmp_path: Path) -> None:
    # a note with runs of numbers of its own (vitals): numbers alone are not text
    vitals = "Vitals 0 0 0 0 0 0 1 1 1 1 1 1 then 98 6 120 80 72 18 98 stable; " + "0" * 45
    g = PrivacyGuard([NOTE, vitals], "restricted")
    rng = np.random.default_rng(1)
    table = pd.DataFrame({"head": [f"L{i // 9}H{i % 9}" for i in range(270)],
                          "importance": rng.normal(size=270), "rank": np.arange(270)})
    table.to_csv(tmp_path / "heads.csv", index=False)
    (tmp_path / "metrics.json").write_text(json.dumps({"micro_f1": 0.41, "codes": ["N18.9", "E11.9"]}))
    (tmp_path / "mask.json").write_text(json.dumps({"mask": [0] * 500 + [1] * 500, "n": "0" * 64}))
    import mistill.io
    import mistill.tracking.privacy

    (tmp_path / "code.py").write_text(Path(mistill.io.__file__).read_text())
    (tmp_path / "guard.py").write_text(Path(mistill.tracking.privacy.__file__).read_text())
    english = ("The report summarises the experiment: we trained the student for two epochs, "
               "evaluated it on the held-out split and compared it with the teacher. The slowest "
               "step was tokenisation; the fastest was scoring. See the table below for details.")
    (tmp_path / "report.md").write_text("\n\n".join([english] * 20))
    g.check_dir(tmp_path)
    g.check_mapping({"lr": 1e-5, "model": "HuggingFaceTB/SmolLM2-135M-Instruct", "k": 40,
                     "remove_discharge_diagnosis": True, "seq": list(range(50))}, "param")
    g.check_dataframe(pd.DataFrame({"note_id": ["n1", "n2"], "split": ["test", "test"]}), "dataset d")
    # the same report with the canary hidden in it is refused
    (tmp_path / "report.md").write_text(english + "\n" + DISGUISES["zwsp-between"](WORDS))
    with pytest.raises(PrivacyError, match="report.md"):
        g.check_dir(tmp_path)


def test_public_texts_are_not_protected() -> None:
    desc = "chronic kidney disease stage 3 unspecified with anemia"
    g = PrivacyGuard([f"Assessment: {desc}. {CANARY}."], "restricted", public_texts=[desc])
    g.check_text(f"N18.30 {desc}", "artifact inventory.csv")
    with pytest.raises(PrivacyError):
        g.check_text(CANARY, "param p")


def test_long_public_descriptions_stay_public_under_every_normalisation(tmp_path: Path) -> None:
    """Descriptions of 40 letters and more, quoted by a note, are still public: in an inventory
    table, JSON, snake_case labels or glued together; the note's own words around them are not."""
    descs = {"E11.65": "Type 2 diabetes mellitus with hyperglycemia and peripheral angiopathy",
             "N18.30": "Chronic kidney disease, stage 3 unspecified, with anemia of chronic disease"}
    note = (f"Assessment: {descs['E11.65']} noted on the second day. Also "
            f"{descs['N18.30']}. The overnight nurse reported agitation near the window.")
    g = PrivacyGuard([note], "restricted", public_texts=list(descs.values()))
    inv = tmp_path / "inventory.json"
    inv.write_text(json.dumps(descs))
    (tmp_path / "inventory.csv").write_text("code,description\n" + "".join(
        f"{c},\"{d}\"\n" for c, d in descs.items()))
    (tmp_path / "labels.json").write_text(json.dumps(
        {c: {"label": d.replace(" ", "_"), "glued": d.replace(" ", "")} for c, d in descs.items()}))
    g.check_dir(tmp_path)
    g.check_mapping({"labels": [d.title().replace(" ", "") for d in descs.values()]}, "param")
    with pytest.raises(PrivacyError):  # the note's own words, glued
        g.check_text("overnightnursereportedagitationnearthewindow", "tag t")


def test_dataframe_text_columns() -> None:
    g = restricted()
    with pytest.raises(PrivacyError, match="column 'text'"):
        g.check_dataframe(pd.DataFrame({"note_id": ["n1"], "text": [CANARY]}), "dataset d")
    with pytest.raises(PrivacyError, match="column 'snake'"):
        g.check_dataframe(pd.DataFrame({"snake": ["_".join(WORDS)]}), "dataset d")
    with pytest.raises(PrivacyError, match="free-text"):  # unprotected but free text
        g.check_dataframe(pd.DataFrame({"t": [" ".join(["word"] * 20)]}), "dataset d")


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
    g.check_dataframe(pd.DataFrame({"gold_codes": ["N18.9 E11.65 I10 J18.9 K58.1 A68.9 Z14.1 C68.9 F42.9"]}),
                      "dataset index")
    notes_quote = "Assessment: type 2 diabetes mellitus with hyperglycemia noted on the second day."
    g2 = PrivacyGuard([notes_quote], "restricted", public_texts=["Type 2 diabetes mellitus with hyperglycemia"])
    g2.check_text('{"E11.65": "Type 2 diabetes mellitus with hyperglycemia"}', "artifact inventory.json")


# ------------------------------------------------------------------------------------ speed
def test_indexing_hundreds_of_long_notes_is_fast() -> None:
    rng = random.Random(0)
    vocab = [f"word{i}" for i in range(5000)]  # (w12-like tokens would read as label codes)
    notes = [" ".join(rng.choice(vocab) for _ in range(3000)) for _ in range(200)]
    t0 = time.perf_counter()
    g = PrivacyGuard(notes, "restricted")
    built = time.perf_counter() - t0
    assert g.n_protected_ngrams > 590_000 and g.n_protected_windows > 590_000
    probe = notes[123].split()[1000:1010]
    other = " ".join(rng.choice(vocab) for _ in range(200_000))
    t0 = time.perf_counter()
    for text in (" ".join(probe[:6]), "_".join(probe[:6]), "".join(probe)):
        with pytest.raises(PrivacyError):
            g.check_text("prefix " + text + " suffix", "artifact a")
    g.check_text(other, "artifact b")  # 200k random words: no 6-gram in common
    checked = time.perf_counter() - t0
    # traces added one at a time, as the generate stage does, do not re-sort the whole index
    t0 = time.perf_counter()
    for note in notes[:60]:
        g.protect([note.replace("word", "trace")])
        g.check_text("a short tag value", "tag t")
    added = time.perf_counter() - t0
    # the bounds are 3-5x what a loaded 2-core machine takes
    assert built < 6.0 and checked < 4.0 and added < 6.0, (built, checked, added)


def _filler(n_chars: int, seed: int) -> str:
    """English-like words (none from the note), joined in every disguise the guard undoes."""
    rng = random.Random(seed)
    vocab = ("report model value table token layer score epoch batch split label result "
             "metric figure average sample random review update number column output").split()
    joins = [" ", "_", "-", "\u200b", "%20", "&nbsp;", " \u0430", "\n"]
    parts, size = [], 0
    while size < n_chars:
        w = rng.choice(vocab)
        w = w.capitalize() if rng.random() < 0.3 else w
        parts.append(w + rng.choice(joins))
        size += len(parts[-1])
    return "".join(parts)


def test_scan_time_is_linear_in_the_candidate_size() -> None:
    g = restricted()
    planted = DISGUISES["camel-cyrillic-url"](WORDS)
    small, large = _filler(512 * 1024, 0) + planted, _filler(2 * 1024 * 1024, 1) + planted

    def best(text: str, repeats: int) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            assert g.contains_protected(text)
            times.append(time.perf_counter() - t0)
        return min(times)

    best(small, 1)  # warm-up: the character tables are built on first use
    t_small, t_large = best(small, 3), best(large, 3)
    # 4x the size: linear means ~4x the time; quadratic would be ~16x. The best of three
    # runs each, and 8x, leave room for a loaded machine.
    assert t_large < 8 * t_small, (t_small, t_large)
    assert not g.contains_protected(large[:-len(planted)])


def test_byte_arrays_are_read_as_utf8(tmp_path: Path) -> None:
    """Raw UTF-8 bytes of protected text: a uint8 numpy array, a JSON list of byte values, a
    pickled list; numeric arrays and long integer lists that are not bytes still pass."""
    g = restricted()
    raw = CANARY.encode()
    np.save(tmp_path / "bytes.npy", np.frombuffer(raw, dtype=np.uint8))
    np.savez(tmp_path / "bytes.npz", b=np.frombuffer(raw, dtype=np.int8))
    (tmp_path / "bytes.json").write_text(json.dumps({"b": list(raw)}))
    torch.save({"b": list(raw)}, tmp_path / "bytes.pt")
    for name in ("bytes.npy", "bytes.npz", "bytes.json", "bytes.pt"):
        with pytest.raises(PrivacyError, match=name):
            g.check_file(tmp_path / name)
    np.save(tmp_path / "mask.npy", np.ones(500, dtype=np.uint8))
    (tmp_path / "ids.json").write_text(json.dumps({"ids": list(range(1000)), "small": list(range(200))}))
    g.check_file(tmp_path / "mask.npy")
    g.check_file(tmp_path / "ids.json")
