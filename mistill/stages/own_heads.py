"""The ``own_heads`` stage: mechanism readouts on a trained arm's own heads (paper App. K, L.4).

1. Rank the arm's heads with the instrument, teacher-forced on the ``rank_split`` notes: the
   ``events`` and ``attribute`` stages on the arm's model, launched through
   :func:`mistill.stages.steps.run_step`, so an identical finished ranking is reused (every
   readout of one arm shares it) and the ranking runs stay visible with their own lineage; a
   ranking run started here is nested under the ``own_heads`` run (``mlflow.parentRunId``).
2. On the ``test_split`` notes, teacher-forced on the teacher's traces: M4 (knock-in recovery of
   the own top-k into the next note's context at matched events, beside count-matched random
   floors, and necessity), M2 (region lift of the own
   top-16 at P1 and P2C), M3 (near-miss share), the prefix share of the own top-16 P2C heads and
   M5 (the forcing probe's locus of every chapter mention, the paper's settings)
   (:mod:`mistill.evaluation.own_heads`).
3. The same on the arm's own generations of the test notes: events from its own reasoning (only
   traces whose reasoning block closes before the cap), the donor being its next usable own
   trace (**[recon]**: the paper does not say which own trace is the donor); coverage counts say
   how many notes and events were usable.

Per-note results are written as the notes finish (resume loses none). Reported values are
medians over notes of the per-note values (App. K "Floors, medians and means"). Generated text
never reaches the tracking store: the own generations are sampled before the model is loaded for
the passes, many notes per engine call (:mod:`mistill.evaluation.sampling`), and each is a local
file of the run's enclave (``<enclave>/own_traces/<note_id>.json``) for every corpus. The
per-note readouts (``m4.json``, ``readside.json``, ``m5.json``, ``generation.json`` with the token
count and seed) are numbers over events and heads, never token ids of the text.

The per-note tables ``own_heads_per_note`` and ``own_heads_readside_per_note`` are also MLflow
tables (``.json``, read back by ``mlflow.load_table``). A run on a train run's checkpoint links it
as its model input and logs the arm params ``arm.name``, ``arm.seed``, ``arm.precision`` (and λ
for a Mistill-objective arm), as ``evaluate`` does (:func:`mistill.stages.common.link_subject`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
from mistill.config import Config
from mistill.data.corpus import Note
from mistill.distributed import broadcast, current_world, gather, shard
from mistill.errors import MistillInputError
from mistill.evaluation.backends import resolve_backend
from mistill.evaluation.generation import DecodingConfig, Generation, note_seed
from mistill.evaluation.own_heads import (m4_rows, m5_note, m5_summary, note_case, own_knockin, place_head,
                                          random_panel, readside_note, subsample_case)
from mistill.evaluation.sampling import SampleRequest
from mistill.instrument.hooks import HeadHook
from mistill.instrument.locus import LocusConfig
from mistill.instrument.passes import PHASES, donor_order
from mistill.instrument.runner import Runner
from mistill.models.geometry import HeadGeometry
from mistill.params import (BackendParams, DonorParams, KnockinReadParams, NomineeParams, NullParams, PatchParams,
                            StabilityParams, TokenCapParams)
from mistill.progress import get_logger, track
from mistill.stages.characterize import AttributeConfig, EventsConfig, ranks_from_head_sets, stage_notes
from mistill.stages.common import (Prepared, RunReader, Subject, link_subject, load_model, load_prepared,
                                   load_tokenizer, model_positions, sample_then_load, trained_subject)
from mistill.stages.runner import note_loop, notes_written, open_stage, progress_label, stage_device
from mistill.stages.steps import LAUNCHES, run_step
from mistill.tracking.naming import TAG_BACKEND, TAG_SPLIT
from mistill.validation import (HEAD_NAME, check_choice, check_counts, check_device, check_dtype, check_model_spec,
                                check_name, check_no_text_fields, check_non_negative, check_pattern, check_positive,
                                check_run_id, check_seed)

NOTES = "notes"
TAG_RANK_ATTRIBUTE = "mistill.rank_attribute"
"""The run's tag naming the attribute run of the arm's own ranking."""
OWN_NOTES = "own_notes"
OWN_TRACES = "own_traces"
TRACES = ("teacher", "own")

_log = get_logger("own_heads")


@dataclass(frozen=True)
class OwnHeadsConfig(Config, KnockinReadParams, DonorParams, TokenCapParams, BackendParams, NullParams,
                     StabilityParams, NomineeParams, PatchParams):
    """Own-heads readouts of one arm: ``train_run`` (model ``run:<id>``) or a plain ``model``.

    rank_split: the notes the arm's heads are ranked on; test_split: the notes measured (empty:
        every split); max_notes: the first n of each (0: all).
    k: own top-k sizes for M4 (each >= 1, no repeats); necessity_k, m2_k (>= 1): the necessity
        size and the M2/M3/prefix set size; n_random: random floor draws per bin, averaged
        (>= 1; the paper draws one per bin, redrawn for every bin, App. K; **[recon]** more
        draws average them).
    own_traces: also measure on the arm's own generations of the test notes, sampled with the
        paper's decoding through ``backend`` (``auto``: vLLM on a CUDA device where it is
        installed, else HF's batched generation; the run's tag ``mistill.backend`` says which).
    launch: how the ranking steps run, ``mlflow`` or ``inline``.
    probe_head, probe_phase, probe_rank: the k = 8 probe of App. I (R-D22): the named head
        (``L35H26``) moved to rank ``probe_rank`` of the arm's own ``probe_phase`` ranking with
        nothing else changed (:func:`~mistill.evaluation.own_heads.place_head`), every readout
        then taken on that ranking. Empty (the default): the own ranking as found. The paper
        reports the probe as a diagnosis beside the own-ranking cell; the report keeps a probe
        run out of the arm tables and shows it beside its arm's own-ranking run.
    """

    prepare_run: str = ""
    train_run: str = ""
    model: str = ""
    rank_split: str = "val"
    test_split: str = "test"
    k: tuple[int, ...] = (8, 40)
    necessity_k: int = 40
    m2_k: int = 16
    n_random: int = 1
    own_traces: bool = True
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    max_notes: int = 0
    launch: str = "mlflow"
    probe_head: str = ""
    probe_phase: str = "P2C"
    probe_rank: int = 8

    def validate(self) -> None:
        check_no_text_fields(self)
        check_run_id(self.prepare_run, "prepare_run")
        check_run_id(self.train_run, "train_run")
        check_model_spec(self.model, "model", allow_empty=True)
        check_name(self.rank_split, "rank_split", "a split", allow_empty=True)
        check_name(self.test_split, "test_split", "a split", allow_empty=True)
        check_counts(self.k, "k")
        check_positive(self.necessity_k, "necessity_k")
        check_positive(self.m2_k, "m2_k")
        check_positive(self.n_random, "n_random")
        check_device(self.device)
        check_dtype(self.dtype)
        check_seed(self.seed)
        check_non_negative(self.max_notes, "max_notes", "0: every note")
        check_choice(self.launch, LAUNCHES, "launch")
        if self.probe_head:
            check_pattern(self.probe_head, HEAD_NAME, "probe_head", "a head name like L35H26")
        check_choice(self.probe_phase, PHASES, "probe_phase")
        check_positive(self.probe_rank, "probe_rank")


def _arm(cfg: OwnHeadsConfig) -> Subject:
    """The model spec and the train run's linking tags."""
    if bool(cfg.train_run) == bool(cfg.model):
        raise MistillInputError("give exactly one of train_run (a trained arm) and model", field="train_run")
    return trained_subject(cfg.train_run) if cfg.train_run else Subject(spec=cfg.model)


def _rank_steps(cfg: OwnHeadsConfig, spec: str, corpus_name: str, parent: str | None = None) -> dict[str, str]:
    """events + attribute of the arm on ``rank_split`` (reused when identical runs exist); runs
    started here are nested under ``parent`` (the ``own_heads`` run)."""
    ev = run_step("events", EventsConfig(prepare_run=cfg.prepare_run, model=spec, dtype=cfg.dtype,
                                         device=cfg.device, split=cfg.rank_split, max_notes=cfg.max_notes,
                                         seed=cfg.seed, **cfg.shared_params(EventsConfig)),
                  corpus_name, launch=cfg.launch, parent=parent)
    att = run_step("attribute", AttributeConfig(events_run=ev, dtype=cfg.dtype, device=cfg.device, seed=cfg.seed,
                                                **cfg.shared_params(AttributeConfig)),
                   corpus_name, launch=cfg.launch, parent=parent)
    return {"events": ev, "attribute": att}


def _test_notes(prepared: Prepared, cfg: OwnHeadsConfig) -> list[Note]:
    """The measured notes; refuses an empty ``test_split`` or ``rank_split`` selection (the
    ranking's events run reads the latter) before any run starts."""
    stage_notes(prepared, cfg.rank_split, cfg.max_notes, field="rank_split")
    return stage_notes(prepared, cfg.test_split, cfg.max_notes, field="test_split")


def _median(values: Sequence[float]) -> float:
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return float(np.median(vals)) if vals else float("nan")


def _floor_spread(sub: pd.DataFrame) -> dict[str, float]:
    """The random floor over its draws (``recovery_random_floors`` per note: draw 0, then the
    spread draws): per draw the median over notes, then the mean and standard deviation over
    draws (``recovery_random_floor_mean``, ``_sd``, ``_draws``). Empty without such draws."""
    if "recovery_random_floors" not in sub:
        return {}
    per_draw: dict[int, list[float]] = {}
    for floors in sub["recovery_random_floors"]:
        if isinstance(floors, str):
            floors = json.loads(floors)
        if not isinstance(floors, (list, tuple)):
            continue
        for d, v in enumerate(floors):
            per_draw.setdefault(d, []).append(v)
    medians = [m for m in (_median(v) for v in per_draw.values()) if math.isfinite(m)]
    if not medians:
        return {}
    return {"recovery_random_floor_mean": float(np.mean(medians)),
            "recovery_random_floor_sd": float(np.std(medians)), "recovery_random_floor_draws": float(len(medians))}


def summary_metrics(per_note: pd.DataFrame, readside: pd.DataFrame, k_bins: Sequence[int],
                    necessity_k: int, prefix: str = "") -> dict[str, float]:
    """Medians over notes of the per-note values, as metrics (``m4/<phase>/k<k>/recovery_own``,
    ``m2/P2C/region_lift``, ...); ``prefix`` (``"own/"``) for the own-trace run."""
    out: dict[str, float] = {}
    for phase in PHASES:
        for k in k_bins:
            sub = per_note[(per_note["phase"] == phase) & (per_note["k"] == k)] if len(per_note) else per_note
            if not len(sub):
                continue
            for col in ("recovery_own", "recovery_random"):
                out[f"{prefix}m4/{phase}/k{k}/{col}"] = _median(sub[col])
            if k == necessity_k:
                out[f"{prefix}m4/{phase}/k{k}/necessity_own"] = _median(sub["necessity_own"])
                out[f"{prefix}m4/{phase}/k{k}/necessity_own_nats"] = _median(sub["necessity_own_nats"])
            out[f"{prefix}m4/{phase}/k{k}/n_notes"] = float(sub["recovery_own"].notna().sum())
            out[f"{prefix}m4/{phase}/k{k}/n_gated"] = float(sub["n_gated"].sum())
            out.update({f"{prefix}m4/{phase}/k{k}/{key}": v for key, v in _floor_spread(sub).items()})
    if len(readside):
        col = readside.get
        for phase in ("P1", "P2C"):
            out[f"{prefix}m2/{phase}/region_lift"] = _median(col(f"own.m2.{phase}", []))
            out[f"{prefix}m2/{phase}/region_lift_random"] = _median(col(f"random.m2.{phase}", []))
        out[f"{prefix}m2/region_lift"] = out[f"{prefix}m2/P2C/region_lift"]
        for key in ("near_miss_share", "own_mention_share", "top_head_near_miss_share"):
            out[f"{prefix}m3/{key}"] = _median(col(f"own.m3.{key}", []))
            out[f"{prefix}m3/{key}_random"] = _median(col(f"random.m3.{key}", []))
        out[f"{prefix}prefix_share"] = _median(col("own.prefix_share", []))
        out[f"{prefix}prefix_share_random"] = _median(col("random.prefix_share", []))
    return {k: v for k, v in out.items() if math.isfinite(v)}


def run_own_heads(cfg: OwnHeadsConfig) -> str:
    arm = _arm(cfg)
    prepared = load_prepared(cfg.prepare_run)
    notes = _test_notes(prepared, cfg)
    inputs = {"prepare": cfg.prepare_run, **({"train": cfg.train_run} if cfg.train_run else {})}
    tags = {**arm.links, TAG_SPLIT: cfg.test_split}
    with open_stage("own_heads", cfg, prepared, inputs=inputs, model=arm.spec, arm=arm.arm,
                    seed=cfg.seed if arm.seed is None else arm.seed, precision=arm.precision, tags=tags) as run:
        if run.reused:
            return run.run_id
        world = current_world()
        if world.leader:
            link_subject(run, arm)
        ranked = _rank_steps(cfg, arm.spec, prepared.corpus.name, parent=run.run_id)
        if world.leader:
            run.set_tags({"mistill.rank_events": ranked["events"], TAG_RANK_ATTRIBUTE: ranked["attribute"]})
        device = stage_device(cfg.device)
        load = lambda: load_model(arm.spec, dtype=cfg.dtype, device=device)  # noqa: E731
        own: dict[str, Generation] = {}
        if cfg.own_traces:  # sampled first: a vLLM engine is freed before the model loads
            own, lm = _sample_own(run, cfg, prepared, arm.spec, notes, load, device)
        else:
            lm = load()
        runner, hook = Runner(lm, chunk_size=cfg.chunk_size), HeadHook(lm.geometry)
        names = lm.geometry.head_names()
        head_sets = json.loads(RunReader(ranked["attribute"], field="attribute").file("head_sets.json").read_text())
        rank = ranks_from_head_sets(head_sets, names)
        if not rank:
            raise MistillInputError(f"the ranking run {ranked['attribute']} has no phase ranking "
                                    f"(no events on the {cfg.rank_split!r} notes)", field="rank_split")
        probe = _probe(cfg, rank, lm.geometry)
        panel = random_panel(lm.geometry.n_total_heads, cfg.m2_k, cfg.seed)
        groups = {"own": {p: r[:cfg.m2_k] for p, r in rank.items()}, "random": {p: panel for p in rank}}
        if world.leader:
            run.log_json("own_heads_sets.json", {
                "rank_attribute": ranked["attribute"], "random_panel": [names[h] for h in panel], **probe,
                **{p: [names[h] for h in r[:max(max(cfg.k), cfg.m2_k)]] for p, r in rank.items()}})
        ctx = _Context(cfg, prepared, lm, runner, hook, rank, groups)
        _teacher_pass(run, ctx, notes)
        coverage: dict[str, float] = {}
        written = notes_written(run, NOTES, notes)
        if cfg.own_traces:
            coverage, usable = _own_pass(run, ctx, notes, own)
            written = notes_written(run, OWN_NOTES, usable)
        if not written:
            return run.run_id
        return _aggregate(run, cfg, notes, coverage)


def _probe(cfg: OwnHeadsConfig, rank: dict[str, list[int]], geometry: HeadGeometry) -> dict:
    """Apply the k = 8 probe to ``rank`` in place (``cfg.probe_head`` moved to ``cfg.probe_rank``
    of the ``cfg.probe_phase`` ranking); returns the record logged with the sets (empty without
    a probe)."""
    if not cfg.probe_head:
        return {}
    if cfg.probe_phase not in rank:
        raise MistillInputError(f"the arm's ranking has no {cfg.probe_phase} phase to place {cfg.probe_head} in",
                                field="probe_phase")
    head = geometry.head_index(cfg.probe_head)
    before = rank[cfg.probe_phase].index(head) + 1 if head in rank[cfg.probe_phase] else None
    rank[cfg.probe_phase] = place_head(rank[cfg.probe_phase], head, cfg.probe_rank)
    _log.info("probe: %s moved from rank %s to rank %d of the own %s ranking", cfg.probe_head, before,
              cfg.probe_rank, cfg.probe_phase)
    return {"probe": {"head": cfg.probe_head, "phase": cfg.probe_phase, "rank": cfg.probe_rank,
                      "own_rank": before}}


@dataclass
class _Context:
    cfg: OwnHeadsConfig
    prepared: Prepared
    lm: object
    runner: object
    hook: object
    rank: dict
    groups: dict

    def case(self, note: Note, trace: str | None = None):
        c = note_case(note, self.prepared.inventory, self.lm, trace=trace,
                      remove_discharge_diagnosis=self.prepared.remove_discharge_diagnosis,
                      narrow_instruction=self.prepared.narrow_instruction,
                      max_positions=model_positions(self.lm))
        return subsample_case(c, self.cfg.events_per_phase, self.cfg.seed)

    def measure(self, target, donors) -> dict:
        """One note's files: its M4 rows (in the donors' contexts; ``donors``: the candidate
        donor notes, next note first, read lazily) and its read side."""
        cfg = self.cfg
        k_bins = tuple(sorted(set(cfg.k) | {cfg.necessity_k}))
        nec, kin = own_knockin(self.runner, self.hook, target, donors, self.rank, k_bins, n_random=cfg.n_random,
                               seed=cfg.seed, range_gate=cfg.range_gate, batch_size=cfg.batch_size,
                               no_match=cfg.donor_no_match, floor_draws=cfg.floor_draws)
        rows = m4_rows(target.note_id, nec, kin, k_bins)
        events = [{"event_id": r["event_id"], "phase": r["phase"], "k": int(r["k"]), "recovery": r["recovery"],
                   "gated": bool(r["gated"])} for r in kin if r["set"] == "global" and r.get("draw", 0) == 0]
        read = readside_note(self.lm, target, self.prepared.inventory, self.groups)
        counts = {p: sum(1 for q in target.queries if q.kind == p) for p in PHASES}
        donor_ids = list(dict.fromkeys(r["donor_id"] for r in kin))
        m5 = m5_note(self.runner, target, self.prepared.inventory, LocusConfig())
        return {"m4.json": {"rows": rows, "donor_ids": donor_ids, "events": events}, "m5.json": {"rows": m5},
                "readside.json": {"values": {k: (v if math.isfinite(v) else None) for k, v in read.items()},
                                  "n_events": counts}}


def _teacher_pass(run, ctx: _Context, notes: list[Note]) -> None:
    """M4, the read side and M5 on the teacher's traces, one note at a time (under a launch,
    each process its share: a note's donors are read here, not measured elsewhere)."""
    cache: dict[str, object] = {}

    def case(note: Note):
        if note.note_id not in cache:
            cache[note.note_id] = ctx.case(note)
        return cache[note.note_id]

    n = len(notes)
    index = {note.note_id: i for i, note in enumerate(notes)}
    for note in note_loop(run, NOTES, notes, desc="own_heads teacher traces"):
        i = index[note.note_id]
        donors = (case(notes[d]) for d in donor_order(n, i, wrap=ctx.cfg.donor_wrap))
        run.write_note(NOTES, note.note_id, ctx.measure(case(note), donors))
        for key in [k for k in cache if k != notes[(i + 1) % n].note_id]:
            cache.pop(key)


def _sample_own(run, cfg: OwnHeadsConfig, prepared: Prepared, spec: str, notes: list[Note], load,
                device: str) -> tuple[dict[str, Generation], object]:
    """The arm's own generation of every note and the loaded model (:func:`sample_then_load`).
    Each process samples its share of the notes; the generations are then exchanged in memory
    (never logged), so every process knows them all. They are staged in the run's local enclave
    (``own_traces/<note_id>.json``), so a resumed run does not sample a note twice."""
    decoding = DecodingConfig(max_new_tokens=cfg.max_new_tokens, seed=cfg.seed)
    tokenizer = load_tokenizer(spec)
    world = current_world()
    requests = [SampleRequest(n.note_id, prepared.prompt(n, tokenizer).text, note_seed(decoding, n.note_id))
                for n in shard(notes, world)]
    mine, lm = sample_then_load(requests, run.enclave_dir / OWN_TRACES, spec, decoding, load, backend=cfg.backend,
                                device=device, dtype=cfg.dtype, desc=progress_label("own_heads generations"))
    if world.leader:
        run.set_tags({TAG_BACKEND: resolve_backend(cfg.backend, device)})
    return {k: v for part in gather(mine, world) for k, v in part.items()}, lm


def _own_pass(run, ctx: _Context, notes: list[Note], own: dict[str, Generation]) -> tuple[dict[str, float], list[Note]]:
    """Keep the usable own traces (``own``: every note's generation; closed reasoning, at least
    one phase event), measure each against the next usable one; returns the coverage counts and
    the usable notes. Under a launch each process measures its share of them."""
    recs = {k: {"text": g.text, "n_tokens": g.n_tokens, "capped": g.capped, "seed": g.seed} for k, g in own.items()}
    cases, closed = {}, 0
    for note in notes:
        rec = recs[note.note_id]
        if rec["capped"]:
            continue
        try:
            case = ctx.case(note, trace=rec["text"])
        except MistillInputError:  # the reasoning block does not close, or the trace is unusable
            continue
        closed += 1
        if case.phase_events():
            cases[note.note_id] = case
    usable = [n for n in notes if n.note_id in cases]
    index = {note.note_id: i for i, note in enumerate(usable)}
    for note in note_loop(run, OWN_NOTES, usable, desc="own_heads own traces"):
        i = index[note.note_id]
        donors = (cases[usable[d].note_id] for d in donor_order(len(usable), i, wrap=ctx.cfg.donor_wrap))
        files = ctx.measure(cases[note.note_id], donors)
        files["generation.json"] = {"n_tokens": recs[note.note_id]["n_tokens"], "seed": recs[note.note_id]["seed"]}
        run.write_note(OWN_NOTES, note.note_id, files)
    return ({"own/coverage/n_notes": float(len(notes)), "own/coverage/n_generated": float(len(recs)),
             "own/coverage/n_closed": float(closed), "own/coverage/n_with_events": float(len(usable))}, usable)


def _aggregate(run, cfg: OwnHeadsConfig, notes: list[Note], coverage: dict[str, float]) -> str:
    per_note, readside, m5, per_event = [], [], {"teacher": [], "own": []}, []
    k_bins = tuple(sorted(set(cfg.k) | {cfg.necessity_k}))
    for traces, subdir in (("teacher", NOTES), ("own", OWN_NOTES)):
        if traces == "own" and not cfg.own_traces:
            continue
        done = run.finished_notes(subdir)
        for note in notes:
            if note.note_id not in done:
                continue
            m4 = run.load_note(subdir, note.note_id, "m4.json")
            rs = run.load_note(subdir, note.note_id, "readside.json")
            m5[traces] += run.load_note(subdir, note.note_id, "m5.json")["rows"]
            per_note += [{**r, "traces": traces} for r in m4["rows"]]
            per_event += [{"note_id": note.note_id, "traces": traces, **e} for e in m4.get("events", [])]
            readside.append({"note_id": note.note_id, "traces": traces,
                             **{k: (float("nan") if v is None else v) for k, v in rs["values"].items()}})
    cols = ["note_id", "traces", "phase", "k", "recovery_own", "gain_own_nats", "recovery_random", "necessity_own",
            "necessity_own_nats", "n_events", "n_matched", "n_gated", "n_random_draws", "recovery_random_floors"]
    table = pd.DataFrame(per_note, columns=cols)
    # per note, the floor's draws as JSON text (an MLflow table cell holds a scalar)
    table["recovery_random_floors"] = [json.dumps([None if v is None or not math.isfinite(v) else v for v in x])
                                       if isinstance(x, list) else "[]" for x in table["recovery_random_floors"]]
    reads = pd.DataFrame(readside)
    run.log_table("own_heads_per_note", table, mlflow_table=True)
    run.log_table("own_heads_knockin_events", pd.DataFrame(
        per_event, columns=["note_id", "traces", "event_id", "phase", "k", "recovery", "gated"]))
    if len(reads):
        run.log_table("own_heads_readside_per_note", reads, mlflow_table=True)
    metrics: dict[str, float] = {"n_notes": float(len(notes))}
    for traces, prefix in (("teacher", ""), ("own", "own/")):
        t = table[table["traces"] == traces]
        r = reads[reads["traces"] == traces] if len(reads) else reads
        metrics.update(summary_metrics(t, r, k_bins, cfg.necessity_k, prefix))
        if m5[traces]:
            metrics.update({f"{prefix}m5/{k}": v for k, v in m5_summary(m5[traces]).items() if math.isfinite(v)})
        if len(t):
            metrics[f"{prefix}coverage/n_notes_measured"] = float(t["note_id"].nunique())
            measurable = t[t["recovery_own"].notna()]["note_id"].nunique()
            metrics[f"{prefix}coverage/n_with_recovery"] = float(measurable)
            first_k = t[t["k"] == k_bins[0]]
            for phase in PHASES:
                metrics[f"{prefix}coverage/n_events/{phase}"] = float(
                    first_k.loc[first_k["phase"] == phase, "n_events"].sum())
    metrics.update(coverage)
    run.log_metrics(metrics)
    _log.info("own_heads: %d notes -> run %s (%s)", len(notes), run.run_name, run.run_id)
    return run.run_id
