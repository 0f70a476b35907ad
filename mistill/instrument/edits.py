"""Edits of the model's input and the margin re-read at the original decision (paper App. E,
"Editing the earlier mention", "Editing the note"; Tables 21-23).

An **edit** replaces characters of the input (an earlier mention in the trace, words of the
note) by others whose tokens are as many, so every later token, the decision's position and its
margin's ids are unchanged (:func:`aligned_edit`). The edited input is **re-fed** from its first
changed token against the clean prefix (:func:`refeed_margins`): the tokens before it are the
clean ones, so their keys and values are too, and the margin at the decision equals that of a
fresh forward of the edited input (up to float32 summation order). The identity edit (the
original tokens through the same path) is the reference; a named head set can be mean-ablated
at the decision token during every read, to measure how much of an edit's effect it mediates.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mistill.data.inventory import category, chapter_letter
from mistill.instrument.hooks import HeadHook, Patch, head_mask
from mistill.instrument.patching import Query, margins_from_logits
from mistill.instrument.runner import KVPrefix, Runner

FILLER_UNITS: tuple[str, ...] = ("-", " -", "x", " x", "=", " =", "~", " ~", "*", " *", "_", " _")
"""**[recon]** The non-code fillers tried, in order, each repeated until its tokens are as many
as the replaced text's (the paper: "a non-code filler of the same token length")."""


@dataclass(frozen=True)
class AlignedEdit:
    """An edited input whose tokens are as many as the original's.

    input_ids: ``[pos]`` the edited tokens; first / last: the first and last positions whose
    token differs from the original (``first > last`` when none does).
    """

    input_ids: torch.Tensor
    first: int
    last: int


def aligned_edit(original: torch.Tensor, edited: torch.Tensor, spans: Sequence[tuple[int, int]], *,
                 slack: int = 1) -> AlignedEdit | None:
    """The edited tokens when they align with the original's, else None.

    They align when the two have the same length and every changed token lies within ``slack``
    tokens of one of ``spans`` (``[start, end)`` token positions of the replaced characters in
    the original): the edit changes only its own tokens, so every other position means what it
    meant.
    """
    if edited.numel() != original.numel():
        return None
    diff = (edited != original).nonzero().flatten()
    if not diff.numel():
        return AlignedEdit(edited, int(original.numel()), -1)
    allowed = torch.zeros(original.numel(), dtype=torch.bool)
    for a, b in spans:
        allowed[max(0, a - slack):b + slack] = True
    if not bool(allowed[diff].all()):
        return None
    return AlignedEdit(edited, int(diff[0]), int(diff[-1]))


STOPWORDS: frozenset[str] = frozenset(
    "and are but for from has had have her his its not nor of off our out she than that the their them then there "
    "these they this those too was were what when where which while who whom why with without you your due other "
    "unspecified specified site type use used any all being into onto over under upon".split())
"""**[recon]** Words never counted as description words: English function words and the
inventory's generic qualifiers ("other", "unspecified", "specified", "site", "type")."""

_WORD = re.compile(r"[a-z]{3,}")


def content_words(text: str) -> set[str]:
    """The lower-cased words of three letters or more in ``text``, :data:`STOPWORDS` left out."""
    return {w for w in _WORD.findall(text.lower()) if w not in STOPWORDS}


def word_spans(text: str, word: str, region: tuple[int, int]) -> list[tuple[int, int]]:
    """Character spans of every whole-word, case-insensitive occurrence of ``word`` within
    ``text[region[0]:region[1]]`` (spans in ``text``)."""
    pattern = re.compile(rf"(?<![A-Za-z0-9]){re.escape(word)}(?![A-Za-z0-9])", re.IGNORECASE)
    return [(m.start(), m.end()) for m in pattern.finditer(text, region[0], region[1])]


def replace_spans(text: str, replacements: Sequence[tuple[tuple[int, int], str]]) -> str:
    """``text`` with each ``(span, replacement)`` applied (spans in ``text``, not overlapping)."""
    out, at = [], 0
    for (a, b), new in sorted(replacements):
        if a < at:
            raise ValueError(f"overlapping spans at {a}")
        out += [text[at:a], new]
        at = b
    return "".join(out) + text[at:]


def token_ids(tokenizer, text: str) -> torch.Tensor:
    """``text``'s token ids as the model reads them (no special tokens added): ``[pos]`` long."""
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def code_shape(text: str) -> str:
    """A code's written shape: letters as ``A``, digits as ``9`` (``N18.9`` -> ``A99.9``)."""
    return re.sub(r"[0-9]", "9", re.sub(r"[A-Za-z]", "A", text))


def written_like(code: str, mention: str) -> str:
    """``code`` written as ``mention`` is (dotted or not)."""
    return code if "." in mention else code.replace(".", "")


def replacement_codes(kind: str, mention: str, code: str, near_miss: str, codes: Sequence[str],
                      seed: int) -> list[str]:
    """Candidate codes for an earlier mention of ``near_miss``, in a seeded order.

    ``"unrelated"``: another chapter's codes (neither the code's nor the near-miss's);
    ``"other_category"``: the same chapter, another category than both. Only codes written in
    the mention's shape (the same characters as letters, digits and dots) are candidates.
    """
    shape = code_shape(mention)
    if kind == "unrelated":
        chapters = {chapter_letter(code), chapter_letter(near_miss)}
        pool = [c for c in codes if chapter_letter(c) not in chapters]
    elif kind == "other_category":
        cats = {category(code), category(near_miss)}
        pool = [c for c in codes if chapter_letter(c) == chapter_letter(near_miss) and category(c) not in cats]
    else:
        raise ValueError(f"unknown replacement kind {kind!r}")
    pool = sorted({c for c in pool if code_shape(written_like(c, mention)) == shape})
    order = np.random.default_rng(seed).permutation(len(pool))
    return [written_like(pool[i], mention) for i in order]


def filler_candidates(n_chars: int) -> list[str]:
    """Non-code fillers to try for a replaced text of ``n_chars`` characters (:data:`FILLER_UNITS`
    repeated 1 .. ``3 * n_chars + 3`` times)."""
    return [unit * m for unit in FILLER_UNITS for m in range(1, 3 * n_chars + 4)]


def refeed_margins(runner: Runner, hook: HeadHook, prefix: KVPrefix, start: int, variants: torch.Tensor,
                   query: Query, *, mean: torch.Tensor | None = None, heads: Sequence[int] = (),
                   max_rows: int = 16384) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Margins at the decision with each variant's tokens re-fed from ``start``.

    The variants run as the batch elements of one causal forward against ``prefix[:start]``
    (as many per forward as fit in ``max_rows`` rows), each ending with the decision token,
    whose row gives the margin; with ``heads``, one more row per element reads the decision
    token again with those heads mean-ablated there, both reads seeing the variant's rows but not
    each other (:meth:`Runner.forward`'s ``own_tail``). The prefix is read, never written. The
    variants' rows run in other kernel shapes than the prefill's, so the unedited tokens
    reproduce the clean margin to rounding: the identity re-feed, run with the edits, is every
    edit's reference.

    Args:
        prefix: the clean input's prefix, at least ``start`` long (shared by every variant).
        variants: ``[variant, query.position + 1 - start]`` each variant's tokens at positions
            ``start .. query.position`` (the query's own token last).
        mean: ``[layer, head, d_head]`` the note's head means, for ``heads``.
    Returns:
        ``[variant]`` float32 margins, and with ``heads`` ``[variant]`` the ablated margins
        (else None).
    """
    n_var, n = variants.shape
    q = query.position
    if start + n != q + 1:
        raise ValueError(f"variants cover positions {start}..{start + n - 1}, the query is at {q}")
    if start > prefix.length:
        raise ValueError(f"the re-feed starts at {start}, beyond the prefix ({prefix.length})")
    g = runner.geometry
    ablate = bool(heads) and mean is not None
    positions = torch.arange(start, q + 1, dtype=torch.long)
    tokens = variants.long()
    patches = []
    if ablate:
        tokens = torch.cat([tokens, tokens[:, -1:]], dim=1)
        positions = torch.cat([positions, positions[-1:]])
        mask = torch.zeros(n + 1, g.n_layers, g.n_heads, dtype=torch.bool, device=runner.device)
        mask[n] = head_mask([list(heads)], g, device=runner.device)[0]
        patches.append(Patch(mask=mask, values=mean))
    read_rows = torch.arange(n - 1, tokens.shape[1], dtype=torch.long)
    out = torch.empty(n_var, len(read_rows), dtype=torch.float32)
    per_forward = max(1, int(max_rows) // tokens.shape[1])
    with torch.no_grad(), hook.patch(*patches):
        for first in range(0, n_var, per_forward):
            batch = tokens[first:first + per_forward]
            res = runner.forward(prefix, start, batch, positions, rows="causal", logits_rows=read_rows,
                                 own_tail=2 if ablate else 0, long_rows=True)
            out[first:first + len(batch)] = margins_from_logits(
                res.logits, query.target_id, query.competitor_ids).float().cpu()
    return (out[:, 0], out[:, 1]) if ablate else (out[:, 0], None)


__all__ = ["FILLER_UNITS", "STOPWORDS", "AlignedEdit", "aligned_edit", "code_shape", "written_like",
           "replacement_codes", "filler_candidates", "token_ids", "refeed_margins", "content_words", "word_spans",
           "replace_spans"]
