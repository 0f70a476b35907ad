"""The ``audit_frame`` stage: the stratified audit frame of contrastive events (Sec. 2.2, App. C;
Table 5, R-C9).

From the teacher's ``events`` run on the audited notes (``events_run``; the paper: the teacher's
traces on the 150 test notes) and the students' ``events`` runs on the same traces
(``align_events_runs``, for tokenizer alignment), every P2C event the teacher's tokenizer realizes
is placed in one of eight strata (alignment x gold status x whether the emitted code reaches the
trace's final answer; :mod:`mistill.evaluation.audit_frame`), ``n`` events are drawn with the
seed, spread over the strata, and the blinded sheet is written: the drawn events in a shuffled
order, each with the trace around the earlier mention of the near-miss and around the decision,
without its stratum, and an empty ``label`` column for the credentialed reader.

The sheet holds trace text, so it is only ever a local file of the run's enclave (tag
``mistill.audit_frame.sheet``), for every corpus. MLflow gets ids, codes and counts: the
``audit_frame`` table (every population event's ids, codes, factors and stratum, whether it was
drawn and its sheet order) and, per stratum, ``audit/population/<stratum>`` and
``audit/drawn/<stratum>``. The reader's labels go to ``report -P audit_labels=<CSV of note_id,
event_id, label>``, which joins them to this run's strata for Table 5 (raw shares with exact
binomial intervals, population-weighted shares) and Table 24.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from mistill.config import Config
from mistill.errors import MistillInputError
from mistill.evaluation.audit_frame import FRAME_COLUMNS, STRATA, draw, frame_rows, sheet_rows
from mistill.evaluation.parsing import parse_answer
from mistill.io import write_text
from mistill.stages.characterize import events_input, read_realized
from mistill.stages.runner import open_stage
from mistill.validation import check_no_text_fields, check_positive, check_run_id, check_run_ids, check_seed

STAGE = "audit_frame"
TAG_SHEET = "mistill.audit_frame.sheet"
"""The local path of the run's blinded sheet."""
SHEET_FILE = "audit_sheet.csv"
FRAME_TABLE = "audit_frame"
"""The run's table of the population (``audit_frame.csv``), which the report joins the labels to."""


@dataclass(frozen=True)
class AuditFrameConfig(Config):
    """The audit's draw and blinded sheet (App. C, Table 5).

    events_run: the teacher's ``events`` run on the audited notes (their traces and gold codes).
    align_events_runs: the students' ``events`` runs on the same prepared corpus: an event is
        aligned when every one of them realizes it (empty: alignment is not read and every event
        counts as aligned).
    n: events drawn (the paper: 181); seed: the draw's and the sheet order's seed.
    context_chars: characters of the trace shown either side of the earlier mention and of the
        decision (**[recon]**: the paper reads "the trace context around" both, unstated width).
    """

    events_run: str = ""
    align_events_runs: tuple[str, ...] = ()
    n: int = 181
    seed: int = 0
    context_chars: int = 300

    def validate(self) -> None:
        check_no_text_fields(self)
        check_run_id(self.events_run, "events_run")
        check_run_ids(self.align_events_runs, "align_events_runs")
        check_positive(self.n, "n")
        check_seed(self.seed)
        check_positive(self.context_chars, "context_chars")


def run_audit_frame(cfg: AuditFrameConfig) -> str:
    ev = events_input(cfg.events_run)
    aligners = [events_input(r) for r in cfg.align_events_runs]
    for other, run_id in zip(aligners, cfg.align_events_runs, strict=True):
        if other.prepared.run_id != ev.prepared.run_id:
            raise MistillInputError(f"events run {run_id} read another corpus ({other.prepared.run_id}) than "
                                    f"events_run's ({ev.prepared.run_id})", field="align_events_runs")
    inputs = {"events": cfg.events_run, **{f"align_events_{i}": r for i, r in enumerate(cfg.align_events_runs)}}
    codes = list(ev.prepared.inventory.codes)
    with open_stage(STAGE, cfg, ev.prepared, inputs=inputs) as run:
        if run.reused:
            return run.run_id
        aligner_notes = [{n.note_id for n in a.notes} for a in aligners]
        rows, traces, spans = [], {}, {}
        for note in ev.notes:
            realized = [r.event for r in read_realized(ev.reader, note.note_id)]
            aligned = {e.event_id for e in realized}  # without students: every event
            for a, noted in zip(aligners, aligner_notes, strict=True):
                aligned &= {r.event.event_id for r in read_realized(a.reader, note.note_id)} \
                    if note.note_id in noted else set()
            answer = parse_answer(note.teacher_trace or "", codes)
            in_answer = set(answer.codes) if answer.valid else set()
            rows += frame_rows([e.to_dict() for e in realized], aligned, set(note.gold_codes), in_answer)
            traces[note.note_id] = note.teacher_trace or ""
            spans.update({(note.note_id, e.event_id): (tuple(e.N[-1]), (e.anchor, e.anchor + 1))
                          for e in realized if e.kind == "P2C" and e.N})
        frame = pd.DataFrame(rows, columns=list(FRAME_COLUMNS))
        if frame.empty:
            raise MistillInputError(f"events run {cfg.events_run} has no realized P2C event to audit",
                                    field="events_run")
        drawn = draw(frame, cfg.n, cfg.seed)
        frame = frame.merge(drawn[["note_id", "event_id", "sheet_order"]], on=["note_id", "event_id"], how="left")
        frame["drawn"] = frame["sheet_order"].notna()
        frame["sheet_order"] = frame["sheet_order"].fillna(0).astype(int)
        frame = frame[[*FRAME_COLUMNS, "drawn", "sheet_order"]]
        sheet = sheet_rows(drawn, traces, spans, cfg.context_chars)
        path = run.enclave_dir / SHEET_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, sheet.to_csv(index=False))
        run.set_tags({TAG_SHEET: str(path)})
        run.log_table(FRAME_TABLE, frame)
        population = frame["stratum"].value_counts()
        taken = drawn["stratum"].value_counts()
        run.log_metrics({**{f"audit/population/{s}": float(population.get(s, 0)) for s in STRATA},
                         **{f"audit/drawn/{s}": float(taken.get(s, 0)) for s in STRATA},
                         "audit/n_population": float(len(frame)), "audit/n_drawn": float(len(drawn))})
        print(f"audit_frame: {len(drawn)} of {len(frame)} contrastive events drawn over "
              f"{int((taken > 0).sum())} strata; the blinded sheet (local only): {path} -> run {run.run_id}")
        return run.run_id


__all__ = ["AuditFrameConfig", "run_audit_frame", "STAGE", "TAG_SHEET", "SHEET_FILE", "FRAME_TABLE"]
