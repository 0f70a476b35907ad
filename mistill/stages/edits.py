"""The ``trace_edit`` stage: does the contrastive decision depend on the earlier mention of the
near-miss? (paper App. E, "Editing the earlier mention"; Tables 21-22).

On an ``attribute`` run's notes (the teacher's, or a student's teacher-forced on the teacher's
traces), at up to ``max_events`` seeded P2C events per note with an earlier mention of the
near-miss, the most recent such mention is replaced by

- ``neutral``: a non-code filler of the same token length (:data:`~mistill.instrument.edits.FILLER_UNITS`),
- ``unrelated``: a code of the same written shape from another chapter,
- ``other_category``: a code of the same shape from the same chapter, another category,

each only where its tokens align with the mention's (:func:`~mistill.instrument.edits.aligned_edit`).
The input is re-fed from the first changed token and the margin read at the original decision;
the identity edit (the original tokens through the same path) is the reference, so an edit's
``effect = margin(identity) - margin(replacement)`` (positive: the edit lowered the margin). The
mediation set (the attribute run's top ``mediation_heads`` contrastive heads, or named) is
mean-ablated at the decision token during a second read of every variant; the share it mediates
is ``1 - effect_ablated / effect``.

Table ``trace_edit`` (Table 21): per replacement, events, mean and median effect, events up / down
with the sign test, the median mediated share over events whose effect exceeds
``mediation_min_effect``; paired per event, neutral minus each code replacement (median, Wilcoxon
and sign test). ``trace_edit_events``: every event's effect per replacement (the report pairs
the students' runs on it, Table 22).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from mistill.config import Config
from mistill.data.inventory import chapter_letter
from mistill.distill.buckets import offsets_array, overlapping_tokens
from mistill.errors import MistillInputError
from mistill.instrument.edits import (aligned_edit, content_words, filler_candidates, refeed_margins, replace_spans,
                                      replacement_codes, token_ids, word_spans)
from mistill.instrument.hooks import HeadHook
from mistill.instrument.inputs import event_queries
from mistill.instrument.passes import seeded_subset, stable_seed
from mistill.instrument.runner import Runner
from mistill.io import dumps
from mistill.params import ChunkParams, EditParams
from mistill.stages.characterize import attribute_input, read_realized
from mistill.stages.common import load_model, prepared_note_input, subject_run_args
from mistill.stages.runner import WrittenNotes, note_loop, notes_written, open_stage, stage_device
from mistill.stats import difference_tests, sign_test, wilcoxon_p
from mistill.tasks import note_items
from mistill.validation import (HEAD_NAME, check_device, check_dtype, check_no_text_fields, check_non_negative,
                                check_pattern, check_run_id, check_seed)

NOTES = "notes"
REPLACEMENTS = ("neutral", "unrelated", "other_category")
NOTE_VARIANTS = ("code_words", "sibling_words", "other_chapter_words", "no_description_words")
EDITED_EVENTS = "edited_P2C_events"
"""The seed part of the P2C events both edits draw: at one seed, trace and note edits read the same events."""


@dataclass(frozen=True)
class TraceEditConfig(Config, EditParams, ChunkParams):
    """Edits of the earlier near-miss mention at contrastive events (App. E, Tables 21-22).

    attribute_run: the ``attribute`` run whose notes, model and P2C ranking are used.
    mediation_heads: the mediation set: comma-separated head names, or empty for the top
    ``n_mediation`` of the run's P2C ranking (**[recon]** for the teacher: the paper names its
    loop-back pair by hand; for the students it takes their own top-2 contrastive heads).
    mediation_min_effect: the mediated share is a median over events whose effect exceeds this
    (the paper: half a nat).
    """

    attribute_run: str = ""
    mediation_heads: str = ""
    n_mediation: int = 2
    mediation_min_effect: float = 0.5
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0

    def validate(self) -> None:
        check_no_text_fields(self)
        check_run_id(self.attribute_run, "attribute_run")
        for name in filter(None, (s.strip() for s in self.mediation_heads.split(","))):
            check_pattern(name, HEAD_NAME, "mediation_heads", "a head name like L30H11")
        check_non_negative(self.n_mediation, "n_mediation")
        check_non_negative(self.mediation_min_effect, "mediation_min_effect")
        check_dtype(self.dtype)
        check_device(self.device)
        check_seed(self.seed)


def mediation_set(cfg: TraceEditConfig, head_sets: dict, names: list[str]) -> list[int]:
    """The flat heads ablated during the mediation reads."""
    chosen = [s.strip() for s in cfg.mediation_heads.split(",") if s.strip()]
    if not chosen:
        chosen = list(head_sets.get("P2C", {}).get("ranking", []))[:cfg.n_mediation]
    index = {n: i for i, n in enumerate(names)}
    missing = [h for h in chosen if h not in index]
    if missing:
        raise MistillInputError(f"mediation heads {missing} are not heads of the model", field="mediation_heads")
    return [index[h] for h in chosen]


def edit_variants(ni, tokenize, r, codes: list[str], cfg: TraceEditConfig, note_id: str):
    """The identity and the replacements of the most recent earlier near-miss mention at event
    ``r``: ``{kind: (AlignedEdit, written replacement)}`` (kinds without an aligned candidate left
    out) and the mention's token span."""
    ev = r.event
    s, e = max(ev.N)
    mention = ni.trace[s:e]
    hit = np.flatnonzero(overlapping_tokens(offsets_array(ni.offsets), [(s, e)], ni.prompt.trace_offset))
    span = (int(hit.min()), int(hit.max()) + 1)
    out = {}
    for kind in REPLACEMENTS:
        if kind == "neutral":
            candidates = filler_candidates(len(mention))
        else:
            candidates = replacement_codes(kind, mention, ev.code, ev.near_miss, codes,
                                           stable_seed(cfg.seed, note_id, ev.event_id, kind))
        for cand in candidates[:cfg.max_tries]:
            edited = tokenize(ni.prompt.full_text(ni.trace[:s] + cand + ni.trace[e:]))
            al = aligned_edit(ni.input_ids, edited, [span])
            if al is not None and al.first <= al.last < r.position:
                out[kind] = (al, cand)
                break
    return out, span


def run_trace_edit(cfg: TraceEditConfig) -> str:
    att = attribute_input(cfg.attribute_run)
    ev, prepared, notes = att.events, att.prepared, att.notes
    head_sets = att.head_sets()
    with open_stage("trace_edit", cfg, prepared, inputs={"attribute": cfg.attribute_run},
                    **subject_run_args(ev.model)) as run:
        if run.reused:
            return run.run_id
        lm = load_model(ev.model, dtype=cfg.dtype, device=stage_device(cfg.device))
        names = lm.geometry.head_names()
        mediation = mediation_set(cfg, head_sets, names)
        run.log_json("trace_edit_mediation.json", {"mediation_heads": [names[h] for h in mediation]})
        runner, hook = Runner(lm, chunk_size=cfg.chunk_size), HeadHook(lm.geometry)
        tokenize = functools.partial(token_ids, lm.tokenizer)

        for note in note_loop(run, NOTES, notes, desc="trace edit"):
            codes = note_items(prepared.inventory, note)
            ni = prepared_note_input(prepared, note, lm.tokenizer)
            picked = seeded_subset([r for r in read_realized(ev.reader, note.note_id)
                                    if r.event.kind == "P2C" and r.event.N], cfg.max_events, cfg.seed,
                                   note.note_id, EDITED_EVENTS)
            rows = []
            if picked:
                queries = event_queries(picked, ni.input_ids)
                with hook.accumulate_mean() as acc:
                    prefix, clean = runner.prefill(ni.input_ids, logits_at=torch.tensor([r.position for r in picked]))
                mean = acc.mean
                for i, (r, eq) in enumerate(zip(picked, queries)):
                    variants, span = edit_variants(ni, tokenize, r, codes, cfg, note.note_id)
                    start = min([span[0]] + [al.first for al, _ in variants.values()])
                    kinds = ["identity", *variants]
                    tokens = torch.stack([ni.input_ids] + [al.input_ids for al, _ in variants.values()])
                    margins, ablated = refeed_margins(runner, hook, prefix, start, tokens[:, start:r.position + 1],
                                                      eq.query, mean=mean, heads=mediation)
                    clean_m = float(clean[i, r.target_id] - torch.logsumexp(clean[i, list(r.competitor_ids)], 0))
                    row = {"event_id": r.event.event_id, "mention_tokens": span[1] - span[0],
                           "refed_tokens": r.position + 1 - start, "clean": clean_m}
                    for j, kind in enumerate(kinds):
                        row[kind] = float(margins[j])
                        row[f"{kind}_ablated"] = float(ablated[j]) if ablated is not None else None
                    for kind in REPLACEMENTS:
                        row.setdefault(kind, None)
                        row.setdefault(f"{kind}_ablated", None)
                        row[f"{kind}_text"] = variants[kind][1] if kind in variants else None
                    rows.append(row)
                del prefix
            run.write_note(NOTES, note.note_id, {"trace_edit.jsonl": "".join(dumps(r) + "\n" for r in rows)})
        if not notes_written(run, NOTES, notes):
            return run.run_id
        reader = WrittenNotes(run, NOTES)
        per_event = pd.DataFrame([{**row, "note_id": note.note_id} for note in notes
                                  for row in reader.jsonl(note.note_id, "trace_edit.jsonl")])
        table = trace_edit_table(per_event, cfg.mediation_min_effect)
        run.log_table("trace_edit", table)
        effects = edit_effects(per_event) if len(per_event) else pd.DataFrame(columns=list(REPLACEMENTS))
        run.log_table("trace_edit_events", pd.concat(
            [per_event.reindex(columns=["note_id", "event_id"]), effects[list(REPLACEMENTS)]], axis=1))
        metrics = {"n_events": float(len(per_event))}
        for _, row in table.iterrows():
            for col in ("effect_mean", "effect_median", "sign_p", "mediated_median"):
                if pd.notna(row.get(col)):
                    metrics[f"trace_edit/{row['comparison']}/{col}"] = float(row[col])
        run.log_metrics(metrics)
        print(f"trace_edit: {len(notes)} notes, {len(per_event)} contrastive events -> run {run.run_id}")
        return run.run_id


def edit_effects(per_event: pd.DataFrame) -> pd.DataFrame:
    """Per event and replacement: ``effect`` (identity minus replacement margin) and
    ``effect_ablated`` (the same with the mediation set ablated); NaN where a kind is missing."""
    out = pd.DataFrame(index=per_event.index)
    for kind in REPLACEMENTS:
        if kind not in per_event:
            out[kind], out[f"{kind}_ablated"] = np.nan, np.nan
            continue
        out[kind] = per_event["identity"] - pd.to_numeric(per_event[kind], errors="coerce")
        out[f"{kind}_ablated"] = (pd.to_numeric(per_event["identity_ablated"], errors="coerce")
                                  - pd.to_numeric(per_event[f"{kind}_ablated"], errors="coerce"))
    return out


def trace_edit_table(per_event: pd.DataFrame, mediation_min_effect: float) -> pd.DataFrame:
    """Table 21 from per-event rows: one row per replacement, then the paired comparisons."""
    rows = []
    cols = ["comparison", "n_events", "effect_mean", "effect_median", "n_positive", "n_negative", "sign_p",
            "wilcoxon_p", "mediated_median", "n_mediated"]
    if not len(per_event):
        return pd.DataFrame(columns=cols)
    eff = edit_effects(per_event)
    for kind in REPLACEMENTS:
        x = eff[kind].to_numpy(float)
        ok = np.isfinite(x)
        x_ok = x[ok]
        big = ok & (x > mediation_min_effect)
        with np.errstate(invalid="ignore", divide="ignore"):
            mediated = 1.0 - eff[f"{kind}_ablated"].to_numpy(float)[big] / x[big]
        mediated = mediated[np.isfinite(mediated)]
        pos, neg = int((x_ok > 0).sum()), int((x_ok < 0).sum())
        rows.append({"comparison": kind, "n_events": int(ok.sum()),
                     "effect_mean": float(x_ok.mean()) if len(x_ok) else math.nan,
                     "effect_median": float(np.median(x_ok)) if len(x_ok) else math.nan,
                     "n_positive": pos, "n_negative": neg, "sign_p": sign_test(pos, neg) if pos + neg else math.nan,
                     "wilcoxon_p": wilcoxon_p(x_ok) if len(x_ok) else math.nan,
                     "mediated_median": float(np.median(mediated)) if len(mediated) else math.nan,
                     "n_mediated": len(mediated)})
    for other in REPLACEMENTS[1:]:
        d = (eff["neutral"] - eff[other]).to_numpy(float)
        d = d[np.isfinite(d)]
        pos, neg = int((d > 0).sum()), int((d < 0).sum())
        rows.append({"comparison": f"neutral_minus_{other}", "n_events": len(d),
                     "effect_mean": float(d.mean()) if len(d) else math.nan,
                     "effect_median": float(np.median(d)) if len(d) else math.nan,
                     "n_positive": pos, "n_negative": neg, "sign_p": sign_test(pos, neg) if pos + neg else math.nan,
                     "wilcoxon_p": wilcoxon_p(d) if len(d) else math.nan})
    return pd.DataFrame(rows).reindex(columns=cols)


@dataclass(frozen=True)
class NoteEditConfig(Config, EditParams, ChunkParams):
    """Edits of the note's words at contrastive events (App. E, "Editing the note"; Table 23).

    attribute_run: the ``attribute`` run whose notes, model and events are used (events whose
    code has no distinguishing description word in the note are counted and left out).
    """

    attribute_run: str = ""
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0

    def validate(self) -> None:
        check_no_text_fields(self)
        check_run_id(self.attribute_run, "attribute_run")
        check_dtype(self.dtype)
        check_device(self.device)
        check_seed(self.seed)


@dataclass(frozen=True)
class DescriptionWords:
    """The inventory's description words, by code and by chapter (:func:`~mistill.instrument.edits.content_words`)."""

    by_code: dict[str, set[str]]
    by_chapter: dict[str, set[str]]

    @classmethod
    def of(cls, inventory) -> DescriptionWords:
        by_code = {c: content_words(inventory.description(c)) for c in inventory.codes}
        by_chapter: dict[str, set[str]] = {}
        for c, words in by_code.items():
            by_chapter.setdefault(chapter_letter(c), set()).update(words)
        return cls(by_code, by_chapter)

    def word_sets(self, code: str, near_miss: str, note_words: set[str], seed: int) -> dict[str, list[str]]:
        """The words each note variant replaces at an event emitting ``code`` against ``near_miss``:
        ``code_words`` (in the code's description, not the near-miss's, and in the note),
        ``sibling_words`` (the reverse), and as many as ``code_words`` of ``other_chapter_words``
        (note words only in other chapters' descriptions) and ``no_description_words`` (note words
        in no description), drawn with ``seed``; a control with too few words is left out."""
        own, sib = self.by_code.get(code, set()), self.by_code.get(near_miss, set())
        out = {"code_words": sorted((own - sib) & note_words), "sibling_words": sorted((sib - own) & note_words)}
        k = len(out["code_words"])
        chapter = self.by_chapter.get(chapter_letter(code), set())
        everywhere = set().union(*self.by_chapter.values())
        pools = {"other_chapter_words": sorted((everywhere - chapter) & note_words),
                 "no_description_words": sorted(note_words - everywhere)}
        rng = np.random.default_rng(seed)
        for name, pool in pools.items():
            if k and len(pool) >= k:
                out[name] = sorted(pool[i] for i in rng.choice(len(pool), k, replace=False))
        return {name: words for name, words in out.items() if words}


def note_word_edit(ni, tokenize, words: list[str], max_tries: int):
    """Every occurrence of ``words`` in the note replaced by fillers of the same token length, one
    filler per word (:func:`~mistill.instrument.edits.filler_candidates`), each accepted only when
    the whole edit still aligns token for token: the edit, or None when a word finds no filler."""
    full = ni.full_text
    region = ni.prompt.span_in_text("note")
    offs = offsets_array(ni.offsets)
    done: list[tuple[tuple[int, int], str]] = []
    token_spans: list[tuple[int, int]] = []
    edit = None
    for word in words:
        spans = word_spans(full, word, region)
        hit = [np.flatnonzero(overlapping_tokens(offs, [sp], 0)) for sp in spans]
        mine = token_spans + [(int(h.min()), int(h.max()) + 1) for h in hit if len(h)]
        for cand in filler_candidates(len(word))[:max_tries]:
            tried = done + [(sp, cand) for sp in spans]
            al = aligned_edit(ni.input_ids, tokenize(replace_spans(full, tried)), mine)
            if al is not None:
                done, token_spans, edit = tried, mine, al
                break
        else:
            return None
    return edit


def run_note_edit(cfg: NoteEditConfig) -> str:
    att = attribute_input(cfg.attribute_run)
    ev, prepared, notes = att.events, att.prepared, att.notes
    words = DescriptionWords.of(prepared.inventory)
    with open_stage("note_edit", cfg, prepared, inputs={"attribute": cfg.attribute_run},
                    **subject_run_args(ev.model)) as run:
        if run.reused:
            return run.run_id
        lm = load_model(ev.model, dtype=cfg.dtype, device=stage_device(cfg.device))
        runner, hook = Runner(lm, chunk_size=cfg.chunk_size), HeadHook(lm.geometry)

        tokenize = functools.partial(token_ids, lm.tokenizer)

        for note in note_loop(run, NOTES, notes, desc="note edit"):
            ni = prepared_note_input(prepared, note, lm.tokenizer)
            picked = seeded_subset([r for r in read_realized(ev.reader, note.note_id)
                                    if r.event.kind == "P2C" and r.event.N], cfg.max_events, cfg.seed,
                                   note.note_id, EDITED_EVENTS)
            note_words = content_words(ni.prompt.part("note"))
            rows, prefix, clean = [], None, None
            for i, (r, eq) in enumerate(zip(picked, event_queries(picked, ni.input_ids))):
                sets = words.word_sets(r.event.code, r.event.near_miss, note_words,
                                       stable_seed(cfg.seed, note.note_id, r.event.event_id, "note_words"))
                row: dict = {"event_id": r.event.event_id, "qualifies": "code_words" in sets}
                if row["qualifies"]:
                    edits = {}
                    for name in NOTE_VARIANTS:
                        if name in sets:
                            al = note_word_edit(ni, tokenize, sets[name], cfg.max_tries)
                            if al is not None and al.first <= al.last < r.position:
                                edits[name] = al
                        row[f"{name}_words"] = len(sets.get(name, []))
                    if prefix is None:
                        positions = torch.tensor([x.position for x in picked])
                        prefix, clean = runner.prefill(ni.input_ids, logits_at=positions)
                    start = min([al.first for al in edits.values()], default=r.position)
                    tokens = torch.stack([ni.input_ids] + [al.input_ids for al in edits.values()])
                    margins, _ = refeed_margins(runner, hook, prefix, start, tokens[:, start:r.position + 1], eq.query)
                    row["clean"] = float(clean[i, r.target_id] - torch.logsumexp(clean[i, list(r.competitor_ids)], 0))
                    row["refed_tokens"] = r.position + 1 - start
                    row["identity"] = float(margins[0])
                    for j, name in enumerate(edits, start=1):
                        row[name] = float(margins[j])
                rows.append(row)
            del prefix
            run.write_note(NOTES, note.note_id, {"note_edit.jsonl": "".join(dumps(r) + "\n" for r in rows)})
        if not notes_written(run, NOTES, notes):
            return run.run_id
        reader = WrittenNotes(run, NOTES)
        per_event = pd.DataFrame([{**row, "note_id": note.note_id} for note in notes
                                  for row in reader.jsonl(note.note_id, "note_edit.jsonl")])
        table = note_edit_table(per_event, seed=cfg.seed)
        run.log_table("note_edit", table)
        n_all = len(per_event)
        n_q = int(per_event["qualifies"].sum()) if n_all else 0
        metrics = {"note_edit/n_events": float(n_all), "note_edit/n_qualifying": float(n_q)}
        for _, row in table.iterrows():
            for col in ("effect_mean", "effect_median", "sign_p"):
                if pd.notna(row.get(col)):
                    metrics[f"note_edit/{row['comparison']}/{col}"] = float(row[col])
        run.log_metrics(metrics)
        print(f"note_edit: {len(notes)} notes, {n_q} of {n_all} contrastive events with a distinguishing word "
              f"in the note -> run {run.run_id}")
        return run.run_id


def note_edit_table(per_event: pd.DataFrame, *, seed: int = 0) -> pd.DataFrame:
    """Table 23 from per-event rows: per variant the effect (identity minus variant margin) over
    qualifying events; then per note the mean effect of ``code_words`` minus each control (mean with
    its bootstrap interval, notes higher / lower, sign test)."""
    cols = ["comparison", "n_events", "n_notes", "effect_mean", "effect_median", "ci_low", "ci_high",
            "n_positive", "n_negative", "sign_p"]
    if not len(per_event) or not per_event["qualifies"].any():
        return pd.DataFrame(columns=cols)
    q = per_event[per_event["qualifies"]]
    eff = pd.DataFrame({name: q["identity"] - pd.to_numeric(q[name], errors="coerce") if name in q else np.nan
                        for name in NOTE_VARIANTS})
    eff["note_id"] = q["note_id"].to_numpy()
    rows = []
    for name in NOTE_VARIANTS:
        x = eff[name].to_numpy(float)
        x = x[np.isfinite(x)]
        pos, neg = int((x > 0).sum()), int((x < 0).sum())
        n_notes = int(eff.loc[eff[name].notna(), "note_id"].nunique())
        rows.append({"comparison": name, "n_events": len(x), "n_notes": n_notes,
                     "effect_mean": float(x.mean()) if len(x) else math.nan,
                     "effect_median": float(np.median(x)) if len(x) else math.nan,
                     "n_positive": pos, "n_negative": neg, "sign_p": sign_test(pos, neg) if pos + neg else math.nan})
    for control in ("other_chapter_words", "no_description_words", "sibling_words"):
        d = (eff["code_words"] - eff[control]).groupby(eff["note_id"], sort=True).mean().dropna()
        paired = (eff["code_words"] - eff[control]).notna()
        row = {"comparison": f"code_words_minus_{control}", "n_events": int(paired.sum()),
               "n_notes": len(d)}
        if len(d):
            t = difference_tests(d.to_numpy(), seed=seed)
            row.update({"effect_mean": t.mean_diff, "effect_median": t.median_diff, "ci_low": t.ci_low,
                        "ci_high": t.ci_high, "n_positive": t.n_higher, "n_negative": t.n_lower, "sign_p": t.sign_p})
        rows.append(row)
    return pd.DataFrame(rows).reindex(columns=cols)


__all__ = ["TraceEditConfig", "run_trace_edit", "REPLACEMENTS", "mediation_set", "edit_variants", "edit_effects",
           "trace_edit_table", "NoteEditConfig", "run_note_edit", "NOTE_VARIANTS", "DescriptionWords",
           "note_word_edit", "note_edit_table"]
