"""The characterization stages: ``events``, ``attribute`` and ``knockin`` (paper Sec. 2–3, App. C–D).

Each stage is one MLflow run that reads its input runs, walks the notes with a progress bar,
writes one artifact folder per finished note (so a crash resumes at the first unfinished note
and loses none), then aggregates the notes into the paper's tables.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from mistill import stats
from mistill.config import Config
from mistill.data.corpus import Note
from mistill.distributed import broadcast, current_world, gather, shard
from mistill.errors import MistillInputError
from mistill.instrument.calibration import (NoteImportance, calibratable_patients, calibrate, head_sets_json,
                                            note_importance_c, ranking, recurrence, sparsity, split_half_stability)
from mistill.instrument.events import (RealizedEvent, coverage_report, entropy_over_choices, event_counts,
                                       extract_events, margin, margin_audit, realize_events)
from mistill.instrument import faithfulness
from mistill.instrument.hooks import HeadHook
from mistill.instrument.inputs import event_queries, note_input, subsample_phase_events, trace_start_token
from mistill.instrument.passes import (AttributionConfig, CleanEvents, DonorCandidate, DonorWork, EventQuery,
                                       KnockinConfig, NoteAttribution, donor_order, donor_reads, floor_draw, own_reads,
                                       per_note_set_rows, phase_means, plan_donors, prefill_note, running_global_top)
from mistill.instrument.runner import Runner
from mistill.instrument.settables import sets_table, to_latex, to_markdown
from mistill.instrument.waves import attribute_waves
from mistill.io import npz_bytes, write_text
from mistill.models.loading import EMBEDDED_DEFAULT
from mistill.params import (AttributeParams, ChunkParams, DonorParams, EventsParams, KnockinParams, NomineeParams,
                            PatchParams, PoolParams)
from mistill.progress import track
from mistill.stages.common import Prepared, RunReader, load_model, load_prepared, model_positions, require_notes
from mistill.stages.runner import WrittenNotes, note_loop, notes_written, open_stage, progress_label, stage_device
from mistill.tasks import note_items, task_for
from mistill.tracking.naming import TAG_STAGE, metric_name
from mistill.validation import (check_choices, check_device, check_dtype, check_interval, check_model_spec, check_name,
                                check_no_text_fields, check_non_negative, check_not_empty, check_positive, check_run_id,
                                check_seed)

NOTES = "notes"


def stage_notes(prepared: Prepared, split: str = "", max_notes: int = 0, *, field: str = "split") -> list[Note]:
    """Notes with a teacher trace, in corpus order, optionally one split, optionally the first n
    (``max_notes`` 0: all). An empty selection is refused (:func:`require_notes`, naming ``field``)."""
    notes = [n for n in prepared.corpus.notes if n.teacher_trace and (not split or n.split == split)]
    notes = require_notes(notes, split, prepared, field=field)
    return notes[:max_notes] if max_notes else notes


SET_NAMES = ("global", "random", "bottom", "own")


# ----------------------------------------------------------------------------------- events

@dataclass(frozen=True)
class EventsConfig(Config, EventsParams, ChunkParams):
    """Event extraction (App. C) realized in ``model``'s tokenizer, with the margin audit.

    split: the notes read (empty: every split); max_notes: the first n of them (0: all).
    device: ``cpu``, ``cuda``, ``cuda:<n>`` or ``mps``.
    """

    prepare_run: str = ""
    model: str = EMBEDDED_DEFAULT
    dtype: str = "float32"
    device: str = "cpu"
    split: str = ""
    max_notes: int = 0
    seed: int = 0

    def validate(self) -> None:
        check_no_text_fields(self)
        check_run_id(self.prepare_run, "prepare_run")
        check_model_spec(self.model, "model")
        check_name(self.split, "split", "a split", allow_empty=True)
        check_not_empty(self.model, "model", "a model spec")
        check_dtype(self.dtype)
        check_device(self.device)
        check_non_negative(self.max_notes, "max_notes", "0: every note")
        check_seed(self.seed)


def _stored_realized(r: RealizedEvent, margin_value: float, entropy: float, allows_text: bool) -> dict:
    row = r.to_dict()
    if r.event.kind == "NULL" and not allows_text:
        row["chunk"] = ""  # the real next token is trace text; codes are public, prose is not
    row["margin"] = margin_value
    row["entropy"] = entropy
    return row


def run_events(cfg: EventsConfig) -> str:
    prepared = load_prepared(cfg.prepare_run)
    notes = stage_notes(prepared, cfg.split, cfg.max_notes)
    with open_stage("events", cfg, prepared, inputs={"prepare": cfg.prepare_run}) as run:
        if run.reused:
            return run.run_id
        guard = run.guard
        lm = load_model(cfg.model, dtype=cfg.dtype, device=stage_device(cfg.device))
        runner = Runner(lm, chunk_size=cfg.chunk_size)
        task = task_for(prepared.inventory)
        for note in note_loop(run, NOTES, notes, desc="events"):
            codes, note_task = note_items(prepared.inventory, note), task.for_note(note)
            ni = note_input(note, prepared.inventory, lm.tokenizer,
                            **prepared.prompt_settings,
                            max_positions=model_positions(lm))
            events = extract_events(note.note_id, ni.trace, codes, tokenizer=lm.tokenizer, seed=cfg.seed,
                                    task=note_task, **cfg.extraction())
            drops: Counter = Counter()
            realized = realize_events(events, full_text=ni.full_text, trace_offset=ni.trace_offset,
                                      tokenizer=lm.tokenizer, input_ids=ni.input_ids.tolist(),
                                      offsets=ni.offsets, codes=codes, drops=drops, task=note_task)
            _, logits = runner.prefill(ni.input_ids, logits_at=torch.tensor([r.position for r in realized],
                                                                            dtype=torch.long))
            rows = []
            for i, r in enumerate(realized):
                m = float(margin(logits[i], r.target_id, list(r.competitor_ids)))
                h = float(entropy_over_choices(logits[i], r.target_id, list(r.competitor_ids)))
                rows.append(_stored_realized(r, m, h, guard.allows_text))
            run.write_note(NOTES, note.note_id, {
                "events.jsonl": "".join(json.dumps(e.to_dict()) + "\n" for e in events),
                "realized.jsonl": "".join(json.dumps(r) + "\n" for r in rows),
                "coverage.json": {"coverage": coverage_report(events, realized),
                                  "drops": {f"{k}:{why}": n for (k, why), n in drops.items()},
                                  "n_tokens": int(ni.input_ids.numel())},
            })
        if not notes_written(run, NOTES, notes):
            return run.run_id
        # aggregate over every note of the run
        reader = WrittenNotes(run, NOTES)
        all_rows, events_by_note, coverage = [], {}, Counter()
        for note in notes:
            rows = reader.jsonl(note.note_id, "realized.jsonl")
            all_rows += rows
            events_by_note[note.note_id] = [RealizedEvent.from_dict(r).event for r in rows]
            cov = reader.json(note.note_id, "coverage.json")["coverage"]
            for kind, c in cov.items():
                coverage[(kind, "extracted")] += c["extracted"]
                coverage[(kind, "realized")] += c["realized"]
        counts = event_counts(events_by_note)
        audit = margin_audit([(r["event"]["kind"], r["margin"], r["entropy"]) for r in all_rows])
        cov_df = pd.DataFrame([{"kind": k, "extracted": coverage[(k, "extracted")],
                                "realized": coverage[(k, "realized")],
                                "share": coverage[(k, "realized")] / coverage[(k, "extracted")]
                                if coverage[(k, "extracted")] else float("nan")}
                               for k in sorted({k for k, _ in coverage})])
        run.log_table("event_counts", counts.reset_index() if counts.index.name else counts)
        run.log_table("margin_audit", audit.reset_index() if audit.index.name else audit)
        run.log_table("coverage", cov_df)
        metrics = {"n_notes": len(notes)}
        for _, row in cov_df.iterrows():
            metrics[metric_name("events", row["kind"], "realized")] = float(row["realized"])
            metrics[metric_name("events", row["kind"], "coverage")] = float(row["share"])
        by_kind = pd.DataFrame(all_rows)
        if len(by_kind):
            kinds = by_kind["event"].map(lambda e: e["kind"])
            for kind in sorted(set(kinds)):
                m = by_kind.loc[kinds == kind, "margin"]
                metrics[metric_name("margin", kind, "median")] = float(m.median())
                metrics[metric_name("margin", kind, "share_below_0")] = float((m < 0).mean())
        run.log_metrics(metrics)
        print(f"events: {len(all_rows)} realized events over {len(notes)} notes -> run {run.run_id}")
        return run.run_id


def read_realized(reader: RunReader, note_id: str) -> list[RealizedEvent]:
    path = reader.note_file(NOTES, note_id, "realized.jsonl")
    return [RealizedEvent.from_dict(json.loads(line)) for line in path.read_text().splitlines() if line]


@dataclass
class EventsInput:
    """An events run and what it was made from."""

    reader: RunReader
    prepared: Prepared
    notes: list[Note]
    model: str


def events_input(events_run: str) -> EventsInput:
    """Open an ``events`` run as a later stage's input: its reader, its prepared corpus, the notes
    it read and its model; a run of another stage is refused."""
    reader = RunReader(events_run, field="events_run")
    if reader.tags.get("mistill.stage") != "events":
        raise MistillInputError(f"run {events_run} is a {reader.tags.get('mistill.stage')!r} run, not events",
                                field="events_run")
    cfg = reader.config
    prepared = load_prepared(cfg["prepare_run"])
    return EventsInput(reader=reader, prepared=prepared,
                        notes=stage_notes(prepared, cfg.get("split", ""), cfg.get("max_notes", 0),
                                          field="events_run"),
                        model=cfg["model"])


# -------------------------------------------------------------------------------- attribute

@dataclass(frozen=True)
class AttributeConfig(Config, AttributeParams, NomineeParams, PatchParams, PoolParams):
    """The attribution pass (App. C) and the calibration into global sets (App. C–D).

    split: the notes ranked, among the events run's notes (empty: all of them); the paper ranks
    the teacher on its 100 characterization notes, the validation notes (Sec. 4.2).
    phase_running_global: **[recon]** the running global ranking the P2 and P2C nominees come
    from: False, the paper's definition (App. C: mean first-order importance over the chapter
    events of the notes already processed) for every kind; True, each phase's own events.
    null_exact_fraction: the share of NULL events patched exactly, in [0, 1]; fdr_q: the BH
    level, in (0, 1].
    """

    events_run: str = ""
    split: str = ""
    dtype: str = "float32"
    device: str = "cpu"
    phase_running_global: bool = False
    null_exact_fraction: float = 0.5
    detach: bool = False
    grad_batch: int = 16
    fdr_q: float = 0.05
    seed: int = 0

    def validate(self) -> None:
        check_no_text_fields(self)
        check_run_id(self.events_run, "events_run")
        check_name(self.split, "split", "a split", allow_empty=True)
        check_dtype(self.dtype)
        check_device(self.device)
        check_interval(self.null_exact_fraction, "null_exact_fraction")
        check_positive(self.grad_batch, "grad_batch")
        check_interval(self.fdr_q, "fdr_q", low_open=True)
        check_seed(self.seed)


def _attribution_config(cfg: AttributeConfig) -> AttributionConfig:
    kinds = ("P1", "NULL") + (("P2", "P2C") if cfg.exact_p2 else ())
    return AttributionConfig(top_nominees=cfg.top_nominees, global_nominees=cfg.global_nominees,
                             p2_top_nominees=cfg.p2_top_nominees, p2_global_nominees=cfg.p2_global_nominees,
                             p2c_top_nominees=cfg.p2c_top_nominees, p2c_global_nominees=cfg.p2c_global_nominees,
                             exact_kinds=kinds, null_exact_fraction=cfg.null_exact_fraction,
                             detach=cfg.detach, batch_size=cfg.batch_size, grad_batch=cfg.grad_batch,
                             chunk_size=cfg.chunk_size, selftest_events=cfg.selftest_events,
                             selftest_notes=cfg.selftest_notes, seed=cfg.seed)


def running_globals(means: dict[str, list[np.ndarray]], cfg: AttributeConfig) -> dict[str, list[int]]:
    """The running global ranking each kind's global nominees come from, ``{kind: flat heads}``
    (as long as the largest global nominee count): the chapter events' for every kind (App. C),
    or with ``cfg.phase_running_global`` each phase's own (NULL: the chapter events').

    means: ``{phase: [per-note mean first-order importance over its events of the phase, [head]]}``
    over the notes already processed.
    """
    k = max(cfg.global_nominees, cfg.p2_global_nominees, cfg.p2c_global_nominees)
    p1 = running_global_top(means.get("P1", []), k)
    out = {"P1": p1, "NULL": p1, "P2": p1, "P2C": p1}
    if cfg.phase_running_global:
        for phase in ("P2", "P2C"):
            out[phase] = running_global_top(means.get(phase, []), k)
    return out


def attribute_notes(ev: EventsInput, split: str) -> list[Note]:
    """The notes an attribute run ranks (and its knock-in runs on): the events run's notes of
    ``split`` (all when empty), in corpus order; an empty selection is refused."""
    if not split:
        return list(ev.notes)
    return require_notes([n for n in ev.notes if n.split == split], split, ev.prepared, field="split")


@dataclass
class AttributeInput:
    """An ``attribute`` run, the events run it read and the notes it ranked."""

    reader: RunReader
    events: EventsInput
    notes: list[Note]

    @property
    def prepared(self) -> Prepared:
        return self.events.prepared

    @property
    def model(self) -> str:
        return self.events.model

    def head_sets(self) -> dict:
        """Its global rankings and sets (``head_sets.json``)."""
        return json.loads(self.reader.file("head_sets.json").read_text())


def attribute_input(run_id: str, *, field: str = "attribute_run") -> AttributeInput:
    """Open an ``attribute`` run as a later stage's input; a run of another stage is refused."""
    reader = RunReader(run_id, field=field)
    stage = reader.tags.get("mistill.stage")
    if stage != "attribute":
        raise MistillInputError(f"run {run_id} is a {stage!r} run, not attribute", field=field)
    ev = events_input(reader.config["events_run"])
    return AttributeInput(reader, ev, attribute_notes(ev, reader.config.get("split", "")))


def _finished_means(run, reader: WrittenNotes, notes: Sequence[Note]) -> dict[str, dict[str, np.ndarray]]:
    """The per-phase first-order means of the notes the run finished before (a resumed pass)."""
    done = run.finished_notes(NOTES)
    out = {}
    for note in notes:
        if note.note_id in done:
            att = NoteAttribution.from_npz(reader.path(note.note_id, "attribution.npz"), note.note_id)
            out[note.note_id] = phase_means(att.kinds, att.first_order)
    return out


def run_attribute(cfg: AttributeConfig) -> str:
    ev = events_input(cfg.events_run)
    prepared = ev.prepared
    notes = attribute_notes(ev, cfg.split)
    with open_stage("attribute", cfg, prepared, inputs={"events": cfg.events_run}, model=ev.model) as run:
        if run.reused:
            return run.run_id
        lm = load_model(ev.model, dtype=cfg.dtype, device=stage_device(cfg.device))
        runner, hook = Runner(lm, chunk_size=cfg.chunk_size), HeadHook(lm.geometry)
        reader = WrittenNotes(run, NOTES)
        world = current_world()
        # each note's nominees come from the running global ranking of the notes before it
        # (App. C): under a launch the notes go in waves, one per process (mistill.instrument.waves)
        done = broadcast(_finished_means(run, reader, notes) if world.leader else None, world)

        def load(note_id: str) -> tuple[torch.Tensor, list[EventQuery]]:
            ni = note_input(by_id[note_id], prepared.inventory, lm.tokenizer,
                            **prepared.prompt_settings)
            return ni.input_ids, event_queries(read_realized(ev.reader, note_id), ni.input_ids)

        by_id = {n.note_id: n for n in notes}
        mine = shard([n for n in notes if n.note_id not in done], world)
        waves = attribute_waves(runner, hook, [n.note_id for n in notes], done, load, _attribution_config(cfg),
                                lambda means: running_globals(means, cfg), world)
        for att in track(waves, desc=progress_label("attribute"), total=len(mine)):
            run.write_note(NOTES, att.note_id, {"attribution.npz": npz_bytes(att.arrays()),
                                                "selftest.json": {"rows": att.selftest}})
        if not notes_written(run, NOTES, notes):
            return run.run_id
        selftests = [row for note in notes for row in reader.json(note.note_id, "selftest.json")["rows"]]
        # calibration over every note
        importances, attributions = [], []
        for note in notes:
            att = NoteAttribution.from_npz(reader.path(note.note_id, "attribution.npz"), note.note_id)
            attributions.append(att)
            importances.append(NoteImportance(note_id=note.note_id, patient_id=note.patient_id,
                                              kinds=np.array(att.kinds), importance=att.importance,
                                              exact_mask=~np.isnan(att.exact)))
        cal = calibrate(importances, q=cfg.fdr_q, seed=cfg.seed)
        names = lm.geometry.head_names()
        sets = head_sets_json(cal, names, pool_k=cfg.pool_k)
        sets["meta"]["model"] = ev.model
        sets["meta"]["geometry"] = lm.geometry.to_dict()
        run.log_json("head_sets.json", sets)
        run.log_metrics({k: float(v) for k, v in cal.summary().items() if v is not None and np.isfinite(v)})
        top_rows = []
        for phase in ("P1", "P2", "P2C"):
            ic = cal.importance_c.get(phase)
            if ic is None or not np.isfinite(ic).any():
                continue
            order = np.argsort(-ic, kind="stable")
            for rank, h in enumerate(order[:40]):
                top_rows.append({"phase": phase, "rank": rank + 1, "head": names[h], "I_c": float(ic[h]),
                                 "I_raw": float(cal.importance[phase][h])})
            sp = sparsity(ic, cal.noise_floor)
            run.log_metrics({metric_name("sparsity", phase, "n_above_floor"): sp["n_above_floor"],
                             metric_name("sparsity", phase, "n_carry_80"): sp["n_carry"]})
            rec = recurrence(importances, phase, head_names=names)
            run.log_table(f"recurrence_{phase}", rec[rec["recurrent"]].head(50) if "recurrent" in rec else rec)
            if len(calibratable_patients(importances, phase)) >= 4:
                stab = split_half_stability(importances, phase, n_splits=cfg.stability_splits, seed=cfg.seed)
                run.log_metrics({metric_name("stability", phase, k): float(v) for k, v in _flatten(stab).items()
                                 if isinstance(v, (int, float)) and np.isfinite(v)})
        run.log_table("importance_c_top40", pd.DataFrame(top_rows))
        _log_faithfulness(run, attributions)
        _log_refinement(run, attributions, importances, cal, names, cfg)
        if selftests:
            st = pd.DataFrame(selftests)
            run.log_table("selftest", st)
            run.log_metrics({metric_name("selftest", *c.split(".")): float(st[c].median())
                             for c in st.columns if c != "event_id"})
        print(f"attribute: {len(notes)} notes calibrated -> run {run.run_id}")
        return run.run_id


REFINEMENT_TOP = (8, 40)
"""The top-k overlaps of the first-order and exact-refined rankings (App. C: 38 of 40)."""


def _log_refinement(run, attributions: list[NoteAttribution], importances: list[NoteImportance],
                    cal, names: list[str], cfg: AttributeConfig) -> None:
    """Within the run, the first-order ranking against the exact-refined one (App. C, "The
    character ranking under the intact hook", Table 9): the calibration repeated on the
    first-order importances alone, then per phase the Spearman correlation of the two ``I_c``
    and their top-8 / top-40 overlaps (metrics ``refinement/<phase>/...``); and table
    ``top8_exact``: each phase's top-8 with the mean exact importance over the phase's events
    that patched it."""
    first = [NoteImportance(note_id=imp.note_id, patient_id=imp.patient_id, kinds=imp.kinds,
                            importance=att.first_order, exact_mask=np.zeros_like(att.first_order, dtype=bool))
             for imp, att in zip(importances, attributions)]
    cal_fo = calibrate(first, q=cfg.fdr_q, seed=cfg.seed)
    metrics, rows = {}, []
    for phase in ("P1", "P2", "P2C"):
        refined, plain = cal.importance_c.get(phase), cal_fo.importance_c.get(phase)
        if refined is None or plain is None or not (np.isfinite(refined).all() and np.isfinite(plain).all()):
            continue
        metrics[metric_name("refinement", phase, "spearman")] = stats.spearman(refined, plain)
        top_r, top_p = np.argsort(-refined, kind="stable"), np.argsort(-plain, kind="stable")
        for k in REFINEMENT_TOP:
            metrics[metric_name("refinement", phase, "top_overlap", k)] = float(len(set(top_r[:k]) & set(top_p[:k])))
        exact = [att.exact[[i for i, kind in enumerate(att.kinds) if kind == phase]] for att in attributions]
        exact = np.concatenate([e for e in exact if e.size]) if any(e.size for e in exact) else np.empty((0, 0))
        for rank, h in enumerate(top_r[:8]):
            col = exact[:, h] if exact.size else np.empty(0)
            patched = col[np.isfinite(col)]
            rows.append({"phase": phase, "rank": rank + 1, "head": names[h], "I_c": float(refined[h]),
                         "mean_exact": float(patched.mean()) if patched.size else float("nan"),
                         "n_events_patched": int(patched.size), "rank_first_order": int(np.flatnonzero(top_p == h)[0]) + 1})
    if metrics:
        run.log_metrics({k: v for k, v in metrics.items() if np.isfinite(v)})
        run.log_table("top8_exact", pd.DataFrame(rows))


def _log_faithfulness(run, attributions: list[NoteAttribution]) -> None:
    """The contribution ``c`` against exact importance at the contrastive events with exact
    patches (Sec. 2.3, :mod:`mistill.instrument.faithfulness`): table ``c_faithfulness`` (one row
    per event) and metrics ``faithfulness/...``; nothing when no event qualifies."""
    rows = faithfulness.event_rows(attributions, "P2C")
    if not rows:
        return
    run.log_table("c_faithfulness", pd.DataFrame(rows))
    values = faithfulness.summary(rows, faithfulness.pooled(attributions, "P2C"))
    run.log_metrics({metric_name("faithfulness", *k.split("/")): v for k, v in values.items()})


def _flatten(d: dict, prefix: str = "") -> dict:
    """A nested dict's leaves under their keys joined by ``/`` (metric name parts)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "/"))
        else:
            out[key] = v
    return out


# ---------------------------------------------------------------------------------- knockin

@dataclass(frozen=True)
class KnockinStageConfig(Config, KnockinParams, DonorParams, PatchParams):
    """Necessity and knock-in of the global sets against random, bottom-k and own sets (App. D).

    The notes are the attribute run's (its ``split``). Each note's events are knocked into the
    next note in corpus order at a matched event with a different emitted choice (Sec. 2.3;
    :func:`~mistill.instrument.passes.plan_donors`).
    sets: any of ``global``, ``random``, ``bottom``, ``own``.
    sets_run: another ``attribute`` run of the same model whose global rankings give the
    ``global`` and ``bottom`` sets (empty: ``attribute_run``'s own). The instruction control
    (App. B, Table 4) knocks HD-001's sets into the traces regenerated without the narrowing
    sentence; the notes, events and own sets stay ``attribute_run``'s.
    """

    attribute_run: str = ""
    dtype: str = "float32"
    device: str = "cpu"
    sets: tuple[str, ...] = SET_NAMES
    seed: int = 0
    sets_run: str = ""

    def validate(self) -> None:
        check_no_text_fields(self)
        check_run_id(self.attribute_run, "attribute_run")
        check_run_id(self.sets_run, "sets_run")
        check_dtype(self.dtype)
        check_device(self.device)
        check_choices(self.sets, SET_NAMES, "sets")
        check_seed(self.seed)


def donor_steps(n_notes: int, plans: dict[int, list[int]]) -> dict[int, list[tuple[int, int]]]:
    """When each (clean note, donor note) pair is swept, ``{step: [(clean, donor), ...]}``.

    Step ``s`` prefills note ``s % n_notes`` once: for its own clean reads when ``s < n_notes``
    and as the donor of every clean note planned there. A donor after its clean note in corpus
    order is swept at its own step, one before it (a wrapped donor) at ``n_notes`` + its index,
    so every clean note's reads exist before its donors are swept.
    """
    out: dict[int, list[tuple[int, int]]] = {}
    for clean, donors in plans.items():
        for d in donors:
            out.setdefault(d if d > clean else n_notes + d, []).append((clean, d))
    return out


def ranks_from_head_sets(sets: dict, names: list[str]) -> dict[str, list[int]]:
    """Each phase's global ranking of a ``head_sets.json`` document, as flat head indices of
    ``names`` (phases without a ranking left out)."""
    index = {n: i for i, n in enumerate(names)}
    return {phase: [index[h] for h in body["ranking"]] for phase, body in sets.items()
            if phase != "meta" and body.get("ranking")}


def _own_ranks(att: NoteAttribution, patient_id: str) -> dict[str, list[int]]:
    ni = NoteImportance(note_id=att.note_id, patient_id=patient_id, kinds=np.array(att.kinds),
                        importance=att.importance)
    out = {}
    for phase in ("P1", "P2", "P2C"):
        c = note_importance_c(ni, phase)  # None when the note lacks the phase or NULL events
        if c is not None:
            out[phase] = list(map(int, ranking(c)))
    return out


@dataclass
class _NoteInputs:
    """What the knock-in pass needs of one note: token ids, queries, trace start, own ranking."""

    input_ids: torch.Tensor
    queries: list[EventQuery]
    trace_start: int
    own_rank: dict[str, list[int]]

    def candidate(self, note_id: str) -> DonorCandidate:
        return DonorCandidate(note_id, self.queries, int(self.input_ids.numel()), self.trace_start)


class _KnockinInputs:
    """Per-note inputs of the knock-in pass, built on first use and kept until released."""

    def __init__(self, prepared: Prepared, ev: EventsInput, att_reader: RunReader, lm, cfg: KnockinStageConfig):
        self.prepared, self.ev, self.att_reader, self.lm, self.cfg = prepared, ev, att_reader, lm, cfg
        self.cache: dict[str, _NoteInputs] = {}

    def __call__(self, note: Note) -> _NoteInputs:
        if note.note_id not in self.cache:
            p = self.prepared
            ni = note_input(note, p.inventory, self.lm.tokenizer,
                            remove_discharge_diagnosis=p.remove_discharge_diagnosis,
                            narrow_instruction=p.narrow_instruction)
            queries = subsample_phase_events(event_queries(read_realized(self.ev.reader, note.note_id), ni.input_ids),
                                             self.cfg.events_per_phase, note.note_id, self.cfg.seed)
            att = NoteAttribution.from_npz(self.att_reader.note_file(NOTES, note.note_id, "attribution.npz"),
                                           note.note_id)
            self.cache[note.note_id] = _NoteInputs(ni.input_ids, queries, trace_start_token(ni),
                                                   _own_ranks(att, note.patient_id))
        return self.cache[note.note_id]

    def release(self, note: Note) -> None:
        self.cache.pop(note.note_id, None)


def _donor_plans(notes: list[Note], todo: list[int], inputs: _KnockinInputs,
                 cfg: KnockinStageConfig) -> dict[int, list[tuple[int, list[tuple[int, EventQuery]]]]]:
    """Per unfinished note: ``[(donor index, [(event index, matched donor event)])]``, the
    donors in corpus order from the next note (:func:`~mistill.instrument.passes.plan_donors`)."""
    n = len(notes)
    plans = {}
    for j in todo:
        order = donor_order(n, j, wrap=cfg.donor_wrap)
        index = {notes[d].note_id: d for d in order}
        mine = inputs(notes[j])
        cands = (inputs(notes[d]).candidate(notes[d].note_id) for d in order)
        plans[j] = [(index[c.note_id], m) for c, m in plan_donors(
            mine.queries, int(mine.input_ids.numel()), mine.trace_start, cands, no_match=cfg.donor_no_match)]
    return plans


def _knockin_notes(run, notes: list[Note], done: set[str], inputs: _KnockinInputs, runner: Runner,
                   hook: HeadHook, kcfg: KnockinConfig, global_rank: dict[str, list[int]],
                   cfg: KnockinStageConfig) -> None:
    """Sweep the notes in corpus order (one prefill per step, :func:`donor_steps`) and write each
    unfinished note once its necessity and every knock-in of its events are measured.

    Under a launch the steps go in waves, one per process (the ``k``-th step of a wave to rank
    ``k``): each process prefills its step's note and reads its own events; the processes
    exchange the clean reads; each then knocks into its note the clean events whose donor it is
    (their clean note was read in an earlier wave or earlier in this one). Every process keeps
    the same book of what is measured, so a note is written, once, by the process of the step
    that completes it, with the rows one process would have written.
    """
    world = current_world()
    n = len(notes)
    index_of = {note.note_id: i for i, note in enumerate(notes)}
    todo = [j for j in range(n) if notes[j].note_id not in done]
    plans = _donor_plans(notes, todo, inputs, cfg)
    schedule = donor_steps(n, {j: [d for d, _ in plans[j]] for j in todo})
    last_use = {j: j for j in range(n)}
    for step, pairs in schedule.items():
        for c, d in pairs:
            last_use[c], last_use[d] = max(last_use[c], step), max(last_use[d], step)
    left = {j: len(plans[j]) for j in todo}
    clean: dict[int, CleanEvents] = {}
    necessity: dict[int, list[dict]] = {}
    knockin: dict[int, list[dict]] = {j: [] for j in todo}
    steps = sorted(set(todo) | set(schedule))
    waves = [steps[w:w + world.size] for w in range(0, len(steps), world.size)]
    bar = track(total=len(shard(steps, world)), desc=progress_label("knock-in"))
    for wave in waves:
        mine = wave[world.rank] if world.rank < len(wave) else None
        own_part = None
        if mine is not None:
            d = mine % n
            note = inputs(notes[d])
            prefix, mean = prefill_note(runner, hook, note.input_ids)
            if mine < n and d in left:
                read, nec = own_reads(runner, hook, prefix, mean, notes[d].note_id, note.queries, kcfg, global_rank,
                                      note.own_rank, trace_start=note.trace_start, progress=False)
                own_part = (read if left[d] else None, nec)
        for step, part in zip(wave, gather(own_part, world)):
            if part is not None:
                if part[0] is not None:
                    clean[step] = part[0]
                necessity[step] = part[1]
        rows: list[dict] = []
        if mine is not None:
            work = [DonorWork(clean[c], matches, inputs(notes[c]).own_rank)
                    for c, _ in schedule.get(mine, []) for donor, matches in plans[c] if donor == mine % n]
            rows = donor_reads(runner, hook, prefix, notes[mine % n].note_id, work, kcfg, global_rank, progress=False)
            del prefix, mean
            bar.update(1)
        for step, step_rows in zip(wave, gather(rows, world)):
            d = step % n
            own = step < n and d in left
            for row in step_rows:
                knockin[index_of[row["note_id"]]].append(row)
            finished = [c for c, _ in schedule.get(step, [])]
            for c in finished:
                left[c] -= 1
            for c in sorted(set(finished) | ({d} if own else set())):
                if left[c] == 0:  # every knock-in of the note's events is measured
                    nec_rows, kin_rows = necessity.pop(c), knockin.pop(c)
                    if step == mine:
                        run.write_note(NOTES, notes[c].note_id, {
                            "necessity.jsonl": "".join(json.dumps(r) + "\n" for r in nec_rows),
                            "knockin.jsonl": "".join(json.dumps(r) + "\n" for r in kin_rows)})
                    clean.pop(c, None)
                    del left[c]
        for j in [j for j, last in last_use.items() if last <= wave[-1]]:
            inputs.release(notes[j])
            del last_use[j]
    bar.close()


def ranking_sets(attribute_run: str, sets_run: str = "") -> dict:
    """The ``head_sets.json`` whose global rankings a reading of ``attribute_run``'s notes uses:
    ``sets_run``'s when given (it must be an ``attribute`` run: a frozen ranking read on other
    inputs), else ``attribute_run``'s."""
    if not sets_run:
        return json.loads(RunReader(attribute_run, field="attribute_run").file("head_sets.json").read_text())
    reader = RunReader(sets_run, field="sets_run")
    if reader.tags.get(TAG_STAGE) != "attribute":
        raise MistillInputError(f"sets_run {sets_run} is not an attribute run", field="sets_run")
    return json.loads(reader.file("head_sets.json").read_text())


def check_ranked_heads(head_sets: dict, names: Sequence[str], field: str) -> None:
    """Refuse a ranking that names heads the model does not have (another model's ranking)."""
    unknown = sorted({h for phase, body in head_sets.items() if phase != "meta"
                      for h in body.get("ranking", [])} - set(names))
    if unknown:
        raise MistillInputError(f"the sets run ranks {len(unknown)} heads this model does not have "
                                f"(first: {unknown[0]})", field=field)


def run_knockin(cfg: KnockinStageConfig) -> str:
    att_reader = RunReader(cfg.attribute_run, field="attribute_run")
    ev = events_input(att_reader.config["events_run"])
    prepared = ev.prepared
    head_sets = ranking_sets(cfg.attribute_run, cfg.sets_run)
    inputs = {"attribute": cfg.attribute_run, **({"sets": cfg.sets_run} if cfg.sets_run else {})}
    with open_stage("knockin", cfg, prepared, inputs=inputs, model=ev.model) as run:
        if run.reused:
            return run.run_id
        lm = load_model(ev.model, dtype=att_reader.config.get("dtype", cfg.dtype), device=stage_device(cfg.device))
        runner, hook = Runner(lm, chunk_size=cfg.chunk_size), HeadHook(lm.geometry)
        names = lm.geometry.head_names()
        check_ranked_heads(head_sets, names, "sets_run" if cfg.sets_run else "attribute_run")
        global_rank = ranks_from_head_sets(head_sets, names)
        kcfg = KnockinConfig(k_bins=cfg.k_bins, sets=cfg.sets, range_gate=cfg.range_gate,
                             batch_size=cfg.batch_size, chunk_size=cfg.chunk_size, seed=cfg.seed,
                             floor_draws=cfg.floor_draws)
        notes = attribute_notes(ev, att_reader.config.get("split", ""))
        world = current_world()
        done = broadcast(run.finished_notes(NOTES) if world.leader else None, world)
        _knockin_notes(run, notes, done, _KnockinInputs(prepared, ev, att_reader, lm, cfg), runner, hook, kcfg,
                       global_rank, cfg)
        if not notes_written(run, NOTES, notes):
            return run.run_id
        # tables over every note
        reader = WrittenNotes(run, NOTES)
        rows, floor_rows = [], []
        for note in notes:
            kin = reader.jsonl(note.note_id, "knockin.jsonl")
            rows += per_note_set_rows(reader.jsonl(note.note_id, "necessity.jsonl"),
                                      [r for r in kin if r["set"] == "random" or floor_draw(r["set"]) is None])
            floor_rows += per_note_set_rows([], [r for r in kin if floor_draw(r["set"]) is not None])
        if not rows:
            raise MistillInputError("no necessity or knock-in rows: no phase events were realized",
                                    field="events_run")
        per_note = pd.DataFrame(rows)
        run.log_table("per_note_sets", per_note)
        table = sets_table(per_note.to_dict("records"))
        run.log_table("sets_table", table)

        write_text(run.work_dir / "sets_table.tex", to_latex(table))
        run.log_artifact_file(run.work_dir / "sets_table.tex")
        write_text(run.work_dir / "sets_table_display.md", to_markdown(table))
        run.log_artifact_file(run.work_dir / "sets_table_display.md")
        metrics = {}
        for _, r in table.iterrows():
            for col in table.columns:
                if col.startswith(("necessity.", "recovery.")) and pd.notna(r[col]):
                    metrics[metric_name(r["phase"], f"k{int(r['k'])}", *col.split("."))] = float(r[col])
        metrics.update(knockin_count_metrics(per_note, floor_rows))
        run.log_metrics(metrics)
        run.log_figure(recovery_figure(per_note), "recovery_vs_k.html")
        print(f"knockin: {len(notes)} notes -> run {run.run_id}")
        return run.run_id


def knockin_count_metrics(per_note: pd.DataFrame, floor_rows: list[dict]) -> dict[str, float]:
    """What each recovery readout rests on, and the random floor's spread over draws.

    Per (phase, k): ``<phase>/k<k>/n_gated`` (the gated events knocked in, summed over notes;
    the gate is per event, so every set shares it), ``<phase>/k<k>/n_notes`` (notes with a
    global-set recovery); from ``floor_rows`` (per-note rows of the sets ``random``,
    ``random1``, ...): ``<phase>/k<k>/recovery/random_floor_mean`` and ``.../random_floor_sd``
    (mean and standard deviation over draws of the draw's median over notes) and
    ``.../random_floor_draws``.
    """
    out: dict[str, float] = {}
    if len(per_note) and "global" in set(per_note["set"]):
        g = per_note[per_note["set"] == "global"]
        for (phase, k), sub in g.groupby(["phase", "k"]):
            out[f"{phase}/k{int(k)}/n_gated"] = float(sub["n_gated"].sum())
            out[f"{phase}/k{int(k)}/n_notes"] = float(sub["recovery"].notna().sum())
    if floor_rows:
        fr = pd.DataFrame(floor_rows)
        for (phase, k), sub in fr.groupby(["phase", "k"]):
            medians = [float(d["recovery"].median()) for _, d in sub.groupby("set") if d["recovery"].notna().any()]
            if medians:
                out[f"{phase}/k{int(k)}/recovery/random_floor_mean"] = float(np.mean(medians))
                out[f"{phase}/k{int(k)}/recovery/random_floor_sd"] = float(np.std(medians))
                out[f"{phase}/k{int(k)}/recovery/random_floor_draws"] = float(len(medians))
    return out


def recovery_figure(per_note: pd.DataFrame):
    """Knock-in recovery against k per phase, global set beside its random and bottom floors."""
    import plotly.graph_objects as go  # deferred: plotly is slow to import
    from plotly.subplots import make_subplots  # deferred: plotly is slow to import

    phases = [p for p in ("P1", "P2", "P2C") if p in set(per_note["phase"])]
    fig = make_subplots(rows=1, cols=max(1, len(phases)), subplot_titles=phases, shared_yaxes=True)
    colors = {"global": "#1f77b4", "random": "#7f7f7f", "bottom": "#d62728", "own": "#2ca02c"}
    for j, phase in enumerate(phases, start=1):
        sub = per_note[per_note["phase"] == phase]
        for set_name, grp in sub.groupby("set"):
            med = grp.groupby("k")["recovery"].median()
            fig.add_trace(go.Scatter(x=med.index.tolist(), y=med.values.tolist(), mode="lines+markers",
                                     name=set_name, legendgroup=set_name, showlegend=j == 1,
                                     line={"color": colors.get(set_name)}), row=1, col=j)
        fig.update_xaxes(type="log", title_text="k (heads)", row=1, col=j)
    fig.update_yaxes(title_text="knock-in recovery (median over notes)", row=1, col=1)
    fig.update_layout(title="Knock-in recovery of the global sets against count-matched controls")
    return fig
