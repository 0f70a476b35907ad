"""The ``flip_cohort`` stage: the evidence-flip test's cohort (App. N.2, R-D35), from the lock to
four condition corpora.

It reads a cohort lock (:func:`mistill.data.flips.load_cohort_lock`; its sha256 is the param
``lock_sha256`` and the tag ``mistill.flip_cohort.lock_sha256``) and a prepared corpus whose
notes carry the teacher's screen traces (``prepare_run``: a ``generate`` run of the teacher, or
any prepared corpus with traces), and goes as far as its files allow:

1. **the draw**: the lock's seeded draw of patients (one note each), patient-disjoint from
   every corpus of ``exclude_prepare_runs`` (the training and test corpora), each drawn note's
   eligibility (teacher success: its screen answer holds a gold code; for a label space of
   free-text answers, App. O's, it matches one under the task's EM);
2. **the proposals** (``proposals``, a JSONL file the author supplies: the platform drafts
   nothing clinical): each checked against its drawn note in ``model``'s tokenizer;
3. **the review** (``ledger``, the reviewer's CSV): the first ``review.budget`` proposals,
   accept or exclude with a reason code;
4. **the freeze**: the ``FROZEN`` file (``frozen``; default: ``FROZEN`` beside the ledger)
   written when absent; when present, the cohort as read now is re-verified against it and
   anything changed since is refused, before any run exists;
5. **the cohort**: the accepted cases as four prepared corpora, one nested run per condition of
   the lock's set (App. N's or App. O's, :data:`~mistill.data.flips.CONDITION_SETS`)
   (tag ``mistill.flip_cohort.condition``), each tagged like a ``prepare`` run, so its run id is
   a ``prepare_run`` of ``generate`` and ``evaluate`` (tags ``mistill.flip_cohort.run.<condition>``
   on the cohort run name them).

Every input is checked before the run is created. ``synthetic_cases`` (a synthetic corpus only,
no proposals or ledger given) makes the proposals and an all-accept ledger with
:func:`mistill.data.flips.synthetic_flip_proposals` in the run's folder, for tests and smoke
settings.

Logged: ``cohort_draw`` (drawn note ids, patient ids hashed for a restricted corpus,
eligibility), ``cohort_accounting.json`` and its counts as metrics (``n_drawn``, ``n_eligible``,
``n_proposals``, ``n_patients_without_proposal``, ``n_reviewed``, ``n_accepted``,
``n_excluded``, ``n_excluded/<reason>``, ``n_not_reached``), ``cohort_cases`` (each checked
proposal: ids, codes, token counts under its masks, edit lengths in words, recorded facts,
decision), ``FROZEN`` and the lock file. Only ids, codes, counts, spans and hashes reach MLflow:
edited notes are texts the privacy guard protects, and a restricted
corpus's condition corpora stay in their local data folders like any note.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from mistill.config import Config, file_digest
from mistill.data.corpus import Corpus
from mistill.data.flips import (CONDITION_SETS, FROZEN_FILE, CheckedCase, CohortLock, Decision, Proposal,
                                accounting, all_accept_ledger, check_proposals, condition_corpus, draw_cohort,
                                eligibility, frozen_record, load_cohort_lock, read_ledger, read_proposals,
                                screen_eligibility, synthetic_flip_proposals, verify_frozen, write_frozen,
                                write_ledger, write_proposals)
from mistill.errors import MistillInputError
from mistill.evaluation.flip_test import screen_answer
from mistill.io import environment_variable, mistill_root, sha256_file
from mistill.models.loading import EMBEDDED_DEFAULT
from mistill.stages.common import (CORPUS_FILE, CORPUS_META_FILE, INVENTORY_FILE, TAG_CONDITION_RUN, TAG_DATA_DIR,
                                   TAG_DATA_IDENTITY, Prepared, corpus_index, load_prepared, load_tokenizer,
                                   prepared_data_dir, privacy_guard, save_prepared, shown_patient_ids)
from mistill.stages.runner import open_stage
from mistill.tasks import task_for
from mistill.tracking.identity import repo_file
from mistill.tracking.naming import TAG_CORPUS_DIGEST
from mistill.tracking.privacy import PrivacyGuard
from mistill.tracking.runs import StageRun
from mistill.validation import (check_model_spec, check_no_text_fields, check_path, check_run_id, check_run_ids,
                                fail)

STAGE = "flip_cohort"
TAG_LOCK_SHA = "mistill.flip_cohort.lock_sha256"
TAG_FROZEN_SHA = "mistill.flip_cohort.frozen_sha256"
TAG_PHASE = "mistill.flip_cohort.phase"
TAG_CONDITION = "mistill.flip_cohort.condition"
TAG_SOURCE_PREPARE = "mistill.flip_cohort.source_prepare_run"
ACCOUNTING_FILE = "cohort_accounting.json"
PHASES = ("draw", "proposals", "cohort")


@dataclass(frozen=True)
class FlipCohortConfig(Config):
    """The evidence-flip cohort: lock, draw, proposals, review, freeze (App. N.2).

    prepare_run: the corpus the cohort is drawn from, its notes carrying the teacher's screen
        traces (a ``generate`` run of the teacher; a prepare or shortlist run with traces).
    exclude_prepare_runs: the corpora whose patients the draw excludes (the training and test
        corpora; the lock's ``disjoint: true`` requires at least one).
    lock: the cohort lock (YAML): draw size and seed, eligibility, review budget, reason codes,
        conditions.
    proposals: the edit proposals (JSONL, one case per line); empty: the draw only.
    ledger: the reviewer's decisions (CSV); empty: the proposals checked, nothing reviewed.
    frozen: the ``FROZEN`` file: re-verified when it exists, else written (the freeze); empty:
        ``FROZEN`` beside the ledger.
    model: whose tokenizer the target and sham masks are token-matched in.
    synthetic_cases: on a synthetic corpus with neither proposals nor ledger, make both (the
        platform's synthetic flips, every proposal accepted) in the run's folder: tests and smoke.
    """

    prepare_run: str = ""
    exclude_prepare_runs: tuple[str, ...] = ()
    lock: str = "projects/configs/cohorts/ef-cohort-embedded.yaml"
    proposals: str = ""
    ledger: str = ""
    frozen: str = ""
    model: str = EMBEDDED_DEFAULT
    synthetic_cases: bool = False

    def validate(self) -> None:
        check_no_text_fields(self)
        check_run_id(self.prepare_run, "prepare_run")
        check_run_ids(self.exclude_prepare_runs, "exclude_prepare_runs")
        check_path(self.lock, "lock", "a cohort lock (.yaml)")
        check_path(self.proposals, "proposals", "a proposals file (.jsonl)", allow_empty=True)
        check_path(self.ledger, "ledger", "a ledger file (.csv)", allow_empty=True)
        check_path(self.frozen, "frozen", "a FROZEN file", allow_empty=True)
        check_model_spec(self.model, "model")
        if self.ledger and not self.proposals:
            fail("a ledger decides proposals: give the proposals file too", "ledger")
        if self.synthetic_cases and (self.proposals or self.ledger):
            fail("synthetic_cases makes its own proposals and ledger: give neither", "synthetic_cases")

    @property
    def frozen_path(self) -> str:
        """The ``FROZEN`` file: ``frozen``, else ``FROZEN`` beside the ledger ('' without one)."""
        if self.frozen:
            return self.frozen
        return str(Path(self.ledger).parent / FROZEN_FILE) if self.ledger else ""

    def content_digests(self) -> dict[str, str]:
        """sha256 of the lock, the proposals, the ledger and the ``FROZEN`` file (when present)."""
        paths = {"lock": repo_file(self.lock), "proposals": self.proposals, "ledger": self.ledger,
                 "frozen": self.frozen_path}
        digests = {name: file_digest(path) for name, path in paths.items()}
        return {name: d for name, d in digests.items() if d is not None}


@dataclass(frozen=True)
class FlipConditionConfig(Config):
    """One condition's corpus of a frozen cohort (the nested run of a ``flip_cohort`` run)."""

    cohort_run: str = ""
    condition: str = "original"
    frozen_sha256: str = ""

    def validate(self) -> None:
        check_no_text_fields(self)
        check_run_id(self.cohort_run, "cohort_run")
        known = sorted({c for conditions in CONDITION_SETS for c in conditions})
        if self.condition not in known:
            fail(f"condition must be one of {known}", "condition")


@dataclass
class _Cohort:
    """Everything read and checked before the run: the draw, the proposals, the decisions."""

    lock: CohortLock
    prepared: Prepared
    drawn: list
    eligibility_of: dict[str, str]
    proposals: list[Proposal]
    checked: list[CheckedCase]
    decisions: list[Decision] | None
    ledger_sha256: str = ""
    frozen: dict[str, Any] | None = None
    frozen_path: str = ""
    frozen_exists: bool = False


def _excluded_patients(runs: tuple[str, ...]) -> set[str]:
    patients: set[str] = set()
    for run_id in runs:
        patients |= {n.patient_id for n in load_prepared(run_id).corpus.notes}
    return patients


def _read_cohort(cfg: FlipCohortConfig, proposals_file: str, ledger_file: str, frozen_file: str) -> _Cohort:
    """Read the lock, draw, check the proposals and the ledger, and re-verify a freeze."""
    lock = load_cohort_lock(repo_file(cfg.lock))
    if lock.disjoint and not cfg.exclude_prepare_runs:
        raise MistillInputError("the lock requires a draw disjoint from the training and test corpora: name "
                                "them", file=lock.path, field="exclude_prepare_runs")
    prepared = load_prepared(cfg.prepare_run)
    excluded = _excluded_patients(cfg.exclude_prepare_runs)
    drawn = draw_cohort(prepared.corpus.notes, excluded, lock.draw_n, lock.draw_seed)
    if not drawn:
        raise MistillInputError(f"no note of the corpus of run {cfg.prepare_run} is left to draw once the "
                                f"{len(excluded)} excluded patients are removed", field="exclude_prepare_runs")
    inventory = prepared.inventory
    task = task_for(inventory)
    free_text = not task.set_valued  # App. O: one answer string, matched by the task's metric
    screen = {n.note_id: screen_answer(task, inventory, n) for n in drawn} if free_text else None
    elig = {n.note_id: screen_eligibility(screen[n.note_id], n.gold_codes, lock.teacher_success) if free_text
            else eligibility(n, inventory, lock.teacher_success) for n in drawn}
    cohort = _Cohort(lock=lock, prepared=prepared, drawn=drawn, eligibility_of=elig, proposals=[], checked=[],
                     decisions=None)
    if not proposals_file:
        return cohort
    tokenizer = load_tokenizer(cfg.model)
    cohort.proposals = read_proposals(proposals_file, lock.conditions)
    cohort.checked = check_proposals(cohort.proposals, drawn, inventory, tokenizer, file=proposals_file,
                                     teacher_success=lock.teacher_success,
                                     removes_discharge_diagnosis=prepared.remove_discharge_diagnosis,
                                     screen=screen, free_text=free_text)
    if not ledger_file:
        return cohort
    cohort.decisions = read_ledger(ledger_file, cohort.proposals, lock)
    cohort.ledger_sha256 = sha256_file(ledger_file)
    accepted_ids = {d.case_id for d in cohort.decisions if d.decision == "accept"}
    accepted = [c for c in cohort.checked if c.case_id in accepted_ids]
    cohort.frozen = frozen_record(lock, cohort.ledger_sha256, cohort.proposals, cohort.decisions, accepted,
                                  prepared.corpus.digest)
    cohort.frozen_path = frozen_file
    cohort.frozen_exists = Path(frozen_file).is_file()
    if cohort.frozen_exists:
        verify_frozen(frozen_file, cohort.frozen)
    return cohort


def _check_config(cfg: FlipCohortConfig) -> None:
    if not cfg.prepare_run:
        raise MistillInputError("a prepare run id is required", field="prepare_run")


def _synthetic_files(cfg: FlipCohortConfig, folder: Path) -> tuple[str, str, str]:
    """The synthetic proposals and all-accept ledger of the draw, written into ``folder``."""
    lock = load_cohort_lock(repo_file(cfg.lock))
    prepared = load_prepared(cfg.prepare_run)
    if prepared.corpus.privacy != "synthetic":
        raise MistillInputError("synthetic cases are made for a synthetic corpus only; give the author's "
                                "proposals and ledger", field="synthetic_cases")
    drawn = draw_cohort(prepared.corpus.notes, _excluded_patients(cfg.exclude_prepare_runs), lock.draw_n,
                        lock.draw_seed)
    eligible = [n for n in drawn if eligibility(n, prepared.inventory, lock.teacher_success) == "eligible"]
    records = synthetic_flip_proposals(eligible, prepared.inventory, load_tokenizer(cfg.model), seed=lock.draw_seed)
    folder.mkdir(parents=True, exist_ok=True)
    proposals = write_proposals(folder / "proposals.jsonl", records)
    ledger = write_ledger(folder / "ledger.csv", all_accept_ledger(records, lock.review_budget))
    frozen = folder / FROZEN_FILE
    frozen.unlink(missing_ok=True)
    return str(proposals), str(ledger), str(frozen)


def _guard(cohort: _Cohort) -> PrivacyGuard:
    """The source corpus's guard with every version's text protected too (each edit in its
    context: an edit's words alone, often a public code description, are not protected)."""
    extra = [text for c in cohort.checked for text in c.texts.values()]
    return privacy_guard(cohort.prepared.corpus, extra_texts=extra)


def _cases_table(cohort: _Cohort) -> pd.DataFrame:
    decided = {d.case_id: d for d in cohort.decisions or []}
    rows = []
    for i, c in enumerate(cohort.checked):
        d = decided.get(c.case_id)
        rows.append({"order": i + 1, "case_id": c.case_id, "note_id": c.note.note_id,
                     "target_code": c.proposal.target_code, "partner_code": c.proposal.partner_code,
                     **{f"{cond}_target_tokens": c.mask_tokens[cond][0] for cond in c.mask_tokens},
                     **{f"{cond}_sham_tokens": c.mask_tokens[cond][1] for cond in c.mask_tokens},
                     "flip_words": c.edit_words["flipped"], "irrelevant_words": c.edit_words["irrelevant"],
                     "facts": " ".join(c.facts),
                     "decision": d.decision if d else ("not_reached" if cohort.decisions is not None else ""),
                     "reason_code": d.reason_code if d else ""})
    return pd.DataFrame(rows)


def run_flip_cohort(cfg: FlipCohortConfig) -> str:
    """Draw, check, review and freeze the cohort as far as the files given allow; returns the run
    id (an identical finished run is reused). Everything is checked before the run exists."""
    _check_config(cfg)
    proposals_file, ledger_file, frozen_file = cfg.proposals, cfg.ledger, cfg.frozen_path
    if cfg.synthetic_cases:
        folder = mistill_root() / "work" / "flip_cohort" / f"synthetic-{cfg.prepare_run}"
        proposals_file, ledger_file, frozen_file = _synthetic_files(cfg, folder)
    cohort = _read_cohort(cfg, proposals_file, ledger_file, frozen_file)
    prepared, lock = cohort.prepared, cohort.lock
    phase = "cohort" if cohort.decisions is not None else "proposals" if proposals_file else "draw"
    guard = _guard(cohort)
    inputs = {"prepare": cfg.prepare_run}
    tags = {TAG_LOCK_SHA: lock.sha256, TAG_PHASE: phase, TAG_SOURCE_PREPARE: cfg.prepare_run}
    with open_stage(STAGE, cfg, prepared, inputs=inputs, guard=guard, tags=tags) as run:
        if run.reused:
            return run.run_id
        if phase == "cohort" and not cohort.frozen_exists:
            write_frozen(frozen_file, cohort.frozen)  # the freeze: before any condition corpus exists
        drawn = cohort.drawn
        shown = shown_patient_ids(prepared.corpus.privacy, [n.patient_id for n in drawn])
        run.log_table("cohort_draw", pd.DataFrame([
            {"order": i + 1, "note_id": n.note_id, "patient_id": pid, "eligibility": cohort.eligibility_of[n.note_id]}
            for i, (n, pid) in enumerate(zip(drawn, shown))]))
        run.log_artifact_file(repo_file(cfg.lock), "lock")
        if cohort.checked:
            run.log_table("cohort_cases", _cases_table(cohort))
        summary = accounting(drawn, cohort.eligibility_of, cohort.proposals, cohort.decisions, lock.review_budget)
        summary.update(lock=lock.to_dict(), phase=phase, source_prepare_run=cfg.prepare_run,
                       exclude_prepare_runs=list(cfg.exclude_prepare_runs))
        if phase == "cohort":
            frozen_sha = sha256_file(frozen_file)
            run.set_tags({TAG_FROZEN_SHA: frozen_sha})
            run.log_artifact_file(frozen_file, "frozen")
            accepted_ids = {d.case_id for d in cohort.decisions if d.decision == "accept"}
            accepted = [c for c in cohort.checked if c.case_id in accepted_ids]
            condition_runs = _write_conditions(run, cohort, accepted, frozen_sha, guard)
            run.set_tags({TAG_CONDITION_RUN + cond: rid for cond, rid in condition_runs.items()})
            summary.update(ledger_sha256=cohort.ledger_sha256, frozen_sha256=frozen_sha,
                           condition_runs=condition_runs, cases=[c.case_id for c in accepted])
        run.log_json(ACCOUNTING_FILE, summary)
        metrics = {"n_drawn": summary["drawn"], "n_eligible": summary["eligible"],
                   **{f"n_ineligible/{k}": v for k, v in summary["ineligible"].items()}}
        if proposals_file:
            metrics.update(n_proposals=summary["proposals"],
                           n_patients_without_proposal=summary["patients_without_proposal"])
        if cohort.decisions is not None:
            metrics.update(n_reviewed=summary["reviewed"], n_accepted=summary["accepted"],
                           n_excluded=summary["excluded"], n_not_reached=summary["not_reached"],
                           **{f"n_excluded/{k}": v for k, v in summary["excluded_by_reason"].items()})
        run.log_metrics(metrics)
        print(f"flip_cohort: {summary['drawn']} drawn, {summary['eligible']} eligible"
              + (f", {summary['proposals']} proposals" if proposals_file else "")
              + (f", {summary['reviewed']} reviewed = {summary['accepted']} accepted + {summary['excluded']} "
                 f"excluded, {summary['not_reached']} not reached" if cohort.decisions is not None else "")
              + f" -> run {run.run_id}")
        return run.run_id


def _write_conditions(run: StageRun, cohort: _Cohort, accepted: list[CheckedCase], frozen_sha: str,
                      guard: PrivacyGuard) -> dict[str, str]:
    """One nested run per condition, each a prepared corpus of the accepted cases."""
    prepared = cohort.prepared
    if not accepted:
        return {}
    out: dict[str, str] = {}
    for cond in cohort.lock.conditions:
        corpus = condition_corpus(prepared.corpus, accepted, cond, name=f"{prepared.corpus.name}-flip-{cond}")
        config = FlipConditionConfig(cohort_run=run.run_id, condition=cond, frozen_sha256=frozen_sha)
        # a nested run of its own, never the run `mlflow run` launched for the cohort
        with environment_variable("MLFLOW_RUN_ID", None), StageRun(
                STAGE, config, corpus=prepared.corpus.name, guard=guard, corpus_digest=corpus.digest,
                inputs={"flip_cohort": run.run_id}, resume=True, root=mistill_root(), parent=run.run_id,
                name=f"{STAGE}-{cond}", tags={TAG_CONDITION: cond, TAG_FROZEN_SHA: frozen_sha},
                description=f"the evidence-flip cohort's {cond} condition: a prepared corpus "
                            "(use its run id as prepare_run)") as child:
            out[cond] = child.run_id
            if child.reused:
                continue
            _save_condition(child, corpus, prepared, cond, run.run_id, frozen_sha)
    return out


def _save_condition(child: StageRun, corpus: Corpus, prepared: Prepared, condition: str, cohort_run: str,
                    frozen_sha: str) -> None:
    """Save one condition's corpus like a prepare run does: data dir, tags, index, data artifacts."""
    data_dir = prepared_data_dir(corpus.name, child.run_id)
    identity = save_prepared(data_dir, corpus, {"remove_discharge_diagnosis": prepared.remove_discharge_diagnosis,
                                                "narrow_instruction": prepared.narrow_instruction,
                                                "source_prepare_run": prepared.run_id, "flip_cohort_run": cohort_run,
                                                "flip_condition": condition, "frozen_sha256": frozen_sha},
                             run_id=child.run_id, identity=child.params)
    child.set_tags({TAG_DATA_DIR: str(data_dir), TAG_CORPUS_DIGEST: corpus.digest, TAG_DATA_IDENTITY: identity})
    index = corpus_index(corpus)
    child.log_dataset(index, name=f"{corpus.name}-index", digest=corpus.digest, context="corpus")
    child.log_table("corpus_index", index)
    child.log_json("flip_cases.json", {n.note_id: {k: v for k, v in n.meta.items()} for n in corpus.notes})
    child.log_artifact_file(data_dir / INVENTORY_FILE, "data")
    if child.guard.allows_text:
        child.log_artifact_file(data_dir / CORPUS_FILE, "data")
        child.log_artifact_file(data_dir / CORPUS_META_FILE, "data")
    child.log_metrics({"n_notes": len(corpus), "n_patients": len({n.patient_id for n in corpus.notes})})


__all__ = ["FlipCohortConfig", "FlipConditionConfig", "run_flip_cohort", "PHASES", "TAG_CONDITION",
           "TAG_LOCK_SHA", "TAG_FROZEN_SHA", "ACCOUNTING_FILE"]
