"""The ``locus`` stage: where the chapter becomes elicitable (paper Sec. 3.4, App. F).

On a characterized model (an ``attribute`` run: its events, its notes, its chapter global set):

1. per note, after one prefill: the forcing probe at every chapter mention (P1 event) under the
   chosen suffix and the compared ones, the window attribution at every attributed mention and
   every NULL position, pass A, the locus-token classes (:func:`mistill.instrument.locus_pass.probe_note`);
2. once, over every note: the prose-time ranking (window importance) and the transport ranking
   (suffix importance), NULL-calibrated, BH-tested and split-half checked exactly as the other
   phases, logged as ``head_sets.json`` with keys ``prose_time`` and ``transport`` (the
   ``targets`` stage pools the teacher's P1 window rows over ``prose_time``);
3. per note again: pass B with the fixed global prose-time set, the follow-through and the
   residual swap (:func:`mistill.instrument.locus_pass.sets_note`);
4. the tables: 25 (suffixes), 26 (outcomes by kind of mention), 27 (locus-token classes),
   28 (where the importance sits), 29 (prose-time top-16 with intervals), 30 (pass A),
   31 (follow-through), 32 (pass B), the residual-swap profile, and distances and jumps.

Each half writes one folder per finished note (``locus/`` and ``locus_sets/``), so a crash
resumes at the first unfinished note and loses none. Per-note files hold numbers, positions
and codes, never note text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from analysis import locus_tables as lt
from mistill.config import Config
from mistill.distributed import broadcast, current_world
from mistill.errors import MistillInputError
from mistill.instrument.calibration import (NoteImportance, calibratable_patients, calibrate, head_sets_json,
                                            importance_c_intervals, ranking, split_half_stability)
from mistill.instrument.hooks import HeadHook
from mistill.instrument.inputs import note_input, trace_start_token
from mistill.instrument.locus import SUFFIXES, LocusConfig, LocusResult
from mistill.instrument.locus_pass import attribution_locus, note_mentions, probe_note, sets_note
from mistill.instrument.locus_reads import locus_reads
from mistill.instrument.locus_tokens import DescriptionWords
from mistill.instrument.passes import prefill_note
from mistill.instrument.runner import Runner
from mistill.io import npz_bytes
from mistill.params import ChunkParams, PoolParams, StabilityParams
from mistill.stages.characterize import events_input, attribute_notes, read_realized
from mistill.stages.common import RunReader, load_model
from mistill.stages.runner import note_loop, notes_written, open_stage, stage_device
from mistill.tasks import task_for
from mistill.tracking.naming import metric_name
from mistill.validation import (check_choice, check_choices, check_counts, check_device, check_dtype, check_interval,
                                check_name, check_no_text_fields, check_non_negative, check_positive, check_run_id,
                                check_seed)

PROBE_NOTES = "locus"
SETS_NOTES = "locus_sets"
PROBE_FILE = "locus.jsonl"
ARRAYS_FILE = "window.npz"
SETS_FILE = "locus_sets.json"


@dataclass(frozen=True)
class LocusStageConfig(Config, ChunkParams, PoolParams, StabilityParams):
    """The locus pass (App. F) on a characterized model.

    attribute_run: the model's ``attribute`` run (its events, notes and chapter global set).
    split: the notes, among the attribute run's (empty: all of them).
    suffix: the forcing suffix (``A``, ``B``, ``D``; the paper's is ``B``); compare_suffixes:
        suffixes whose walk-back is re-run for Table 25 (empty: none).
    theta: the decisive forced margin in nats (the paper: 2); step: the walk-back's grid in
        tokens (8); max_back: how far back the walk goes (512); extra_steps: grid points probed
        past the crossing for the curve's shape (4).
    width: the attribution window, tokens ending at the locus (64).
    pass_k: set sizes of passes A and B (each >= 1); position_k: the k of pass A's window-only
        and suffix-only rows (16); follow_k: the set size of the follow-through (16).
    swap_layers: the residual swap's layer grid; **[recon]** empty: every 4th layer from 0 (the
        paper names L4 and L12-L28 without stating its grid); tail: the
        window positions the tail swap replaces (8).
    max_mentions: at most this many chapter mentions per note, the first ones (0: all), a
        setting for quick runs.
    fdr_q: the BH level of the prose-time and transport rankings.
    """

    attribute_run: str = ""
    split: str = ""
    suffix: str = "B"
    compare_suffixes: tuple[str, ...] = ("A", "D")
    theta: float = 2.0
    step: int = 8
    max_back: int = 512
    extra_steps: int = 4
    width: int = 64
    pass_k: tuple[int, ...] = (8, 16)
    position_k: int = 16
    follow_k: int = 16
    swap_layers: tuple[int, ...] = ()
    tail: int = 8
    max_mentions: int = 0
    fdr_q: float = 0.05
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0

    def validate(self) -> None:
        check_no_text_fields(self)
        check_run_id(self.attribute_run, "attribute_run")
        check_name(self.split, "split", "a split", allow_empty=True)
        check_choice(self.suffix, tuple(SUFFIXES), "suffix")
        check_choices(self.compare_suffixes, tuple(SUFFIXES), "compare_suffixes", non_empty=False)
        check_positive(self.theta, "theta")
        for name in ("step", "max_back", "width", "position_k", "follow_k", "tail"):
            check_positive(getattr(self, name), name)
        check_non_negative(self.extra_steps, "extra_steps")
        check_non_negative(self.max_mentions, "max_mentions", "0: every mention")
        check_counts(self.pass_k, "pass_k")
        if any(int(x) < 0 for x in self.swap_layers):
            raise MistillInputError("swap_layers must be layer indices >= 0", field="swap_layers")
        check_interval(self.fdr_q, "fdr_q", low_open=True)
        check_dtype(self.dtype)
        check_device(self.device)
        check_seed(self.seed)

    def locus_config(self):
        return LocusConfig(theta=self.theta, step=self.step, max_back=self.max_back,
                           extra_steps=self.extra_steps, suffix=self.suffix)


def _ranking(head_sets: dict, key: str, names: Sequence[str]) -> list[int]:
    index = {n: i for i, n in enumerate(names)}
    body = head_sets.get(key)
    if not body or not body.get("ranking"):
        raise MistillInputError(f"head_sets.json has no {key} ranking", field=key)
    return [index[h] for h in body["ranking"]]


def read_panel(prose: Sequence[int], emission: Sequence[int], n_heads: int, k: int, seed: int) -> dict[str, list[int]]:
    """Table 33's four groups: the prose-time top-k, the emission top-k, the prose-time bottom-k
    and k random heads (one seeded draw for the run)."""
    rng = np.random.default_rng(seed)
    return {"prose_top": list(prose[:k]), "emission_top": list(emission[:k]), "prose_bottom": list(prose[::-1][:k]),
            "random": sorted(rng.choice(n_heads, size=min(k, n_heads), replace=False).tolist())}


def _swap_layers(cfg: LocusStageConfig, n_layers: int) -> list[int]:
    layers = list(cfg.swap_layers) or list(range(0, n_layers, 4))
    bad = [x for x in layers if x >= n_layers]
    if bad:
        raise MistillInputError(f"swap_layers {bad} beyond the model's {n_layers} layers", field="swap_layers")
    return layers


def run_locus(cfg: LocusStageConfig) -> str:
    """Run (or resume, or reuse) the locus pass; returns the run id."""
    att = RunReader(cfg.attribute_run, field="attribute_run")
    if att.tags.get("mistill.stage") != "attribute":
        raise MistillInputError(f"run {cfg.attribute_run} is a {att.tags.get('mistill.stage')!r} run, not attribute",
                                field="attribute_run")
    ev = events_input(att.config["events_run"])
    prepared = ev.prepared
    notes = attribute_notes(ev, cfg.split or att.config.get("split", ""))
    with open_stage("locus", cfg, prepared, inputs={"attribute": cfg.attribute_run}, model=ev.model) as run:
        if run.reused:
            return run.run_id
        world = current_world()
        lm = load_model(ev.model, dtype=cfg.dtype, device=stage_device(cfg.device))
        runner, hook = Runner(lm, chunk_size=cfg.chunk_size), HeadHook(lm.geometry)
        names = lm.geometry.head_names()
        emission = _ranking(json.loads(att.file("head_sets.json").read_text()), "P1", names)
        words = DescriptionWords(prepared.inventory)
        lcfg = cfg.locus_config()
        codes = list(prepared.inventory)
        task = task_for(prepared.inventory)

        def open_note(note):
            ni = note_input(note, prepared.inventory, lm.tokenizer,
                            **prepared.prompt_settings)
            realized = read_realized(ev.reader, note.note_id)
            spans = task.find_mentions(ni.trace, codes)
            mentions = note_mentions(realized, ni.offsets, ni.trace_offset, spans)
            if cfg.max_mentions:
                mentions = mentions[:cfg.max_mentions]
            prefix, mean = prefill_note(runner, hook, ni.input_ids)
            code_spans = [(ni.trace_offset + s, ni.trace_offset + e) for _, s, e in spans]
            return ni, realized, mentions, prefix, mean, code_spans

        for note in note_loop(run, PROBE_NOTES, notes, desc="locus probes"):
            ni, realized, mentions, prefix, mean, code_spans = open_note(note)
            nulls = [r for r in realized if r.event.kind == "NULL"]
            res = probe_note(runner, hook, prefix, mean, note_id=note.note_id, input_ids=ni.input_ids,
                             full_text=ni.full_text, offsets=ni.offsets, trace_start=trace_start_token(ni),
                             mentions=mentions, nulls=nulls, tokenizer=lm.tokenizer, words=words,
                             code_spans=code_spans, emission_rank=emission, cfg=lcfg,
                             compare_suffixes=cfg.compare_suffixes, width=cfg.width, pass_k=cfg.pass_k,
                             position_k=cfg.position_k, seed=cfg.seed)
            arrays = {"event_ids": np.array(res.event_ids, dtype=str), "kinds": np.array(res.kinds, dtype=str),
                      "window": res.window, "suffix": res.suffix}
            run.write_note(PROBE_NOTES, note.note_id, {
                PROBE_FILE: "".join(json.dumps(r, sort_keys=True) + "\n" for r in res.rows),
                ARRAYS_FILE: npz_bytes(arrays), "window_classes.json": res.class_counts})
            del prefix
        shared = None
        if notes_written(run, PROBE_NOTES, notes):  # the calibration needs every note's probes
            probe_rows, importances = _read_probe_notes(run, notes)
            sets = _calibrated_sets(run, cfg, importances, names)
            prose = _ranking(sets, "prose_time", names) if "prose_time" in sets else []
            read_groups = read_panel(prose, emission, lm.geometry.n_total_heads, cfg.follow_k, cfg.seed)
            run.log_json("read_panel.json", {k: [names[h] for h in v] for k, v in read_groups.items()})
            shared = probe_rows, sets, prose, read_groups
        probe_rows, sets, prose, read_groups = broadcast(shared, world)
        set_notes = notes if prose else []
        for note in note_loop(run, SETS_NOTES, set_notes, desc="locus sets"):
            rows = [r for r in probe_rows if r["note_id"] == note.note_id]
            if not any(r.get("attributed") for r in rows):
                run.write_note(SETS_NOTES, note.note_id, {SETS_FILE: {"pass_b": [], "follow_through": [], "swap": [],
                                                                      "reads": []}})
                continue
            ni, realized, mentions, prefix, mean, _ = open_note(note)
            out = sets_note(runner, hook, prefix, mean, note_id=note.note_id, input_ids=ni.input_ids,
                            mentions=mentions, probe_rows=rows, tokenizer=lm.tokenizer, prose_rank=prose,
                            emission_rank=emission, cfg=lcfg, width=cfg.width, pass_k=cfg.pass_k,
                            follow_k=cfg.follow_k, swap_layers=_swap_layers(cfg, lm.geometry.n_layers),
                            tail=cfg.tail, seed=cfg.seed)
            loci = [(attribution_locus(LocusResult.from_dict(r), r["q"], lcfg), r["code"][0])
                    for r in rows if r.get("attributed")]
            reads = locus_reads(lm, ni.input_ids, ni.prompt, ni.trace, ni.offsets, loci, read_groups)
            out["reads"] = [{"note_id": note.note_id, "event_id": r["event_id"], **v}
                            for r, v in zip([r for r in rows if r.get("attributed")], reads)]
            run.write_note(SETS_NOTES, note.note_id, {SETS_FILE: out})
            del prefix
        if not notes_written(run, SETS_NOTES, set_notes):
            return run.run_id
        _tables(run, cfg, notes, probe_rows, sets, emission, names)
        run.set_tags({"mistill.split": cfg.split or att.config.get("split", "")})
        print(f"locus: {len(notes)} notes, {len(probe_rows)} chapter mentions -> run {run.run_id}")
        return run.run_id


def _read_probe_notes(run, notes) -> tuple[list[dict], list]:
    """Every note's probe rows and its window/suffix importances (``NoteImportance`` pairs)."""
    rows, importances = [], []
    for note in notes:
        path = run.note_dir(PROBE_NOTES, note.note_id) / PROBE_FILE
        if not path.exists():
            run.load_note(PROBE_NOTES, note.note_id, PROBE_FILE)
        rows += [json.loads(line) for line in path.read_text().splitlines() if line]
        arr_path = run.note_dir(PROBE_NOTES, note.note_id) / ARRAYS_FILE
        if not arr_path.exists():
            run.load_note(PROBE_NOTES, note.note_id, ARRAYS_FILE)
        with np.load(arr_path) as z:
            kinds = z["kinds"].astype(str)
            if len(kinds):
                importances.append((
                    NoteImportance(note_id=note.note_id, patient_id=note.patient_id, kinds=kinds, importance=z["window"]),
                    NoteImportance(note_id=note.note_id, patient_id=note.patient_id, kinds=kinds, importance=z["suffix"])))
    return rows, importances


def _calibrated_sets(run, cfg: LocusStageConfig, importances, names: Sequence[str]) -> dict:
    """The prose-time (window) and transport (suffix) rankings, calibrated as the other phases:
    ``head_sets.json`` with keys ``prose_time`` and ``transport`` (each in the attribute
    run's per-phase format), logged with the calibration's metrics."""
    doc: dict = {"meta": {"n_heads": len(names), "phases": ["prose_time", "transport"]}}
    for key, idx in (("prose_time", 0), ("transport", 1)):
        per_note = [pair[idx] for pair in importances]
        if not per_note:
            continue
        cal = calibrate(per_note, phases=("P1",), q=cfg.fdr_q, seed=cfg.seed)
        sets = head_sets_json(cal, names, pool_k=cfg.pool_k)
        if "P1" not in sets:
            continue
        doc[key] = sets["P1"]
        doc["meta"][key] = sets["meta"]
        if len(cal.per_note_c["P1"]) >= 2:
            top = ranking(cal.importance_c["P1"])[:16]
            ci = importance_c_intervals(cal, "P1", top, seed=cfg.seed)
            doc[key]["intervals"] = {names[h]: [ci[int(h)].low, ci[int(h)].high] for h in top}
        run.log_metrics({f"calib/{key}/{k.split('/', 2)[2]}": float(v) for k, v in cal.summary().items()
                         if k.startswith("calib/P1/") and np.isfinite(v)})
        if len(calibratable_patients(per_note, "P1")) >= 4:
            stab = split_half_stability(per_note, "P1", n_splits=cfg.stability_splits, seed=cfg.seed)
            run.log_metrics({metric_name("stability", key, k): float(v) for k, v in stab.items()
                             if isinstance(v, (int, float)) and np.isfinite(v)})
    run.log_json("head_sets.json", doc)
    return doc


def _read_sets_notes(run, notes) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {"pass_b": [], "follow_through": [], "swap": [], "reads": []}
    for note in notes:
        path = run.note_dir(SETS_NOTES, note.note_id) / SETS_FILE
        if not path.exists():
            try:
                run.load_note(SETS_NOTES, note.note_id, SETS_FILE)
            except MistillInputError:
                continue
        body = json.loads(path.read_text())
        for key in out:
            out[key] += body.get(key, [])
    return out


def _tables(run, cfg: LocusStageConfig, notes, probe_rows: list[dict], sets: dict, emission: Sequence[int],
            names: Sequence[str]) -> None:
    """Aggregate the notes into the paper's tables (:mod:`analysis.locus_tables`) and metrics."""
    probes = pd.DataFrame(probe_rows)
    second = _read_sets_notes(run, notes)
    classes = {}
    for note in notes:
        path = run.note_dir(PROBE_NOTES, note.note_id) / "window_classes.json"
        if not path.exists():
            run.load_note(PROBE_NOTES, note.note_id, "window_classes.json")
        for k, v in json.loads(path.read_text()).items():
            classes[k] = classes.get(k, 0) + int(v)
    tables = {
        "table25_suffixes": lt.suffix_table(probes, cfg.suffix, cfg.compare_suffixes),
        "table26_outcomes": lt.outcome_table(probes),
        "table27_locus_tokens": lt.locus_token_table(probes, classes),
        "table28_importance_position": lt.position_table(probes),
        "table29_prose_time": lt.prose_time_table(sets, names, emission),
        "table30_pass_a": lt.pass_a_table(probes, cfg.pass_k, cfg.position_k),
        "table31_follow_through": lt.follow_through_table(pd.DataFrame(second["follow_through"])),
        "table32_pass_b": lt.pass_b_table(pd.DataFrame(second["pass_b"]), cfg.pass_k),
        "residual_swap": lt.swap_table(pd.DataFrame(second["swap"])),
        "table33_locus_reads": lt.reads_table(pd.DataFrame(second["reads"])),
        "locus_distances": lt.distance_table(probes),
    }
    for name, table in tables.items():
        if table is not None and len(table):
            run.log_table(name, table)
    if len(probes):
        shown = [c for c in ("note_id", "event_id", "code", "mention_kind", "outcome", "distance", "jump",
                             "locus_class", "attributed") if c in probes]
        run.log_table("locus_mentions", probes[shown])
    run.log_metrics(lt.summary_metrics(probes, pd.DataFrame(second["pass_b"]),
                                       pd.DataFrame(second["follow_through"]), cfg.follow_k))
