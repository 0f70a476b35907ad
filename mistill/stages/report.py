"""MLflow entry point ``report``: the paper's tables and figures from the tracking store.

Reads the FINISHED ``knockin``, ``evaluate``, ``own_heads`` and ``select_lambda`` runs of
experiment ``mistill/<corpus>`` (the newest of each model, arm, precision and seed), the
``attribute`` runs the knockin runs name, every ``train`` run and the newest ``locus``,
``read_side``, ``key_block``, ``trace_edit`` and ``note_edit`` run of each model, builds Tables
1/10, 2, 43, 3/45, the λ cells, Tables 11, 15, 16-23, 25-33 and 39-42 and 47-51 and App.
M.3's carriers (``pool_carriers``: the supervised pools among each arm's own top-40), Table 53 and
Figure 8 (the learning curve over the train runs' ``train_notes``), App. I.5's training cost per arm
and, for the runs ``replicate_runs`` names, App. L.5/L.6's replicate pairing
(:mod:`analysis.training_tables`) with :mod:`analysis`, and logs to one ``report`` run:

* ``report.md``: every table, which tables were skipped or have no rows and why, and the
  deviations from the paper found in the runs read;
* ``deviations.json``: those deviations (registry findings, ``mistill.deviation`` tags);
* ``tables/<name>.csv`` and ``.md`` (numeric), ``tables/<name>_display.md`` and ``.tex``;
* ``figures/<name>.html``: plotly figures with plotly.js embedded (open in the MLflow UI);
* ``tables/verify.csv`` / ``.md`` and a last section of ``report.md``: the paper's expected values
  against the store, as the ``verify`` stage reads them (:mod:`mistill.stages.verify`).

Every input run is recorded as lineage (``mistill.input.<stage>.<run id>``), so an identical
request over the same runs with the same code reuses the finished report, and a new or rerun
input run gives a new report.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlflow
from mlflow.tracking import MlflowClient

from analysis.audit import read_audit_labels
from analysis.report import TableChoices, build_report, collect_inputs
from analysis.training_tables import parse_replicate_pairs
from mistill.config import Config, file_digest
from mistill.errors import MistillInputError
from mistill.instrument.settables import to_latex, to_markdown
from mistill.io import write_text
from mistill.stages.common import mistill_root
from mistill.stages.registry import stage_help
from mistill.stages.verify import verify_markdown, verify_store
from mistill.stats import N_BOOTSTRAP, N_BOOTSTRAP_CORPUS
from mistill.tracking.privacy import PrivacyGuard
from mistill.tracking.experiments import EXPERIMENT_PREFIX, experiment_for_corpus, resolve_tracking_uri
from mistill.tracking.runs import StageRun
from mistill.validation import (check_arm, check_arms, check_counts, check_name, check_names, check_no_text_fields,
                                check_not_empty, check_path, check_positive, check_run_ids, check_seed)


@dataclass(frozen=True)
class ReportConfig(Config):
    """What the report reads and how it tests.

    corpus: the corpus name; the runs read and the report run are in ``mistill/<corpus>``.
    reference_arm: the arm every other arm of the same model is compared against (**[recon]**
        Tables 40/41: the paper's same-notes Vanilla run is this arm on the lock's split).
    arms: keep only these arms' evaluate and own-heads runs (plus the reference, ``teacher``
        and ``untrained``); empty keeps every arm.
    split: the notes the evaluate and own-heads runs read must be these (``test``).
    own_heads_split: the notes the own-heads runs read, where they differ from ``split`` (empty:
        ``split``): App. O reads the students' own heads on its ranking questions and App. P on
        the development assessment batch (``val``), while their answers are evaluated on ``test``.
    bootstrap: resamples of the per-note bootstrap intervals (App. L: 1,000; >= 1).
    corpus_bootstrap: resamples of the corpus-level micro-F1 difference (App. L: 10,000; >= 1).
    seed: seed of every bootstrap (>= 0).
    importance_heads: **[recon]** Table 11 lists the heads in the top ``importance_heads`` of
        any phase (>= 1).
    profile_k: **[recon]** a head's write-side profile names the phases in whose top
        ``profile_k`` it ranks (>= 1).
    layer_blocks: **[recon]** Table 11's layer blocks, as increasing fractions of the depth in
        (0, 1) (the paper's 0-11 / 12-23 / 24-31 / 32-39 of 40 layers).
    ce_steps: Table 48's optimiser steps (each >= 1, no repeats).
    sign_alpha: **[recon]** Table 50's direction: an ablation is higher or lower than Mistill
        at P2C when the paired sign test's p is below this, else level (in (0, 1)).
    audit_labels: a local CSV of audited contrastive events (``note_id, event_id, label``; the
        label ``verified_rejection`` or another class) for Table 24; empty: Table 24 says why it
        has no rows. The file joins the report's identity by content; only the strata's
        aggregates are logged.
    compare_attribute_runs: attribute runs taken in pairs (run A, run B, ...), each pair's
        rankings and knock-in put side by side (Table 9: ``detach=false`` against ``detach=true``
        on the same notes; Table 35: the shortlist against the full inventory; Table 36: a second
        reasoner); empty: the pairs of one model on one events run differing in ``detach``.
    compare_labels: one name per run of ``compare_attribute_runs`` (empty: each run's model, or
        the setting its pair differs in).
    replicate_runs: runs taken in pairs (run a, run b, ...), each pair read side by side note by
        note (App. L.5, L.6): two ``evaluate`` runs, or two ``own_heads`` runs, of one
        configuration (a same-seed replicate, one checkpoint read on other hardware); any FINISHED
        run of the experiment, of any split. Empty: no replicate table.
    """

    corpus: str = "synthetic"
    reference_arm: str = "vanilla-bf16"
    arms: tuple[str, ...] = ()
    split: str = "test"
    own_heads_split: str = ""
    bootstrap: int = N_BOOTSTRAP
    corpus_bootstrap: int = N_BOOTSTRAP_CORPUS
    seed: int = 0
    importance_heads: int = 8
    profile_k: int = 40
    layer_blocks: tuple[float, ...] = (0.3, 0.6, 0.8)
    ce_steps: tuple[int, ...] = (5, 20, 60, 120)
    sign_alpha: float = 0.05
    audit_labels: str = ""
    compare_attribute_runs: tuple[str, ...] = ()
    compare_labels: tuple[str, ...] = ()
    replicate_runs: tuple[str, ...] = ()

    def validate(self) -> None:
        check_no_text_fields(self)
        check_not_empty(self.corpus, "corpus", "the corpus whose experiment is read")
        check_name(self.corpus, "corpus", "the corpus whose experiment is read")
        check_not_empty(self.reference_arm, "reference_arm", "the arm every other arm is compared against")
        check_arm(self.reference_arm, "reference_arm")
        check_name(self.split, "split", "a split", allow_empty=True)
        check_name(self.own_heads_split, "own_heads_split", "a split", allow_empty=True)
        if any(not arm.strip() for arm in self.arms):
            raise MistillInputError(f"arms holds an empty name: {list(self.arms)}", field="arms")
        check_arms(self.arms, "arms")
        check_positive(self.bootstrap, "bootstrap")
        check_positive(self.corpus_bootstrap, "corpus_bootstrap")
        check_seed(self.seed)
        check_positive(self.importance_heads, "importance_heads")
        check_positive(self.profile_k, "profile_k")
        check_counts(self.ce_steps, "ce_steps")
        if not 0 < self.sign_alpha < 1:
            raise MistillInputError(f"sign_alpha must lie in (0, 1), got {self.sign_alpha}", field="sign_alpha")

        check_path(self.audit_labels, "audit_labels", "an audit labels file (.csv)", allow_empty=True)
        check_run_ids(self.compare_attribute_runs, "compare_attribute_runs")
        if len(self.compare_attribute_runs) % 2:
            raise MistillInputError(f"compare_attribute_runs takes runs in pairs, got "
                                    f"{len(self.compare_attribute_runs)}", field="compare_attribute_runs")
        check_names(self.compare_labels, "compare_labels", "a compared run")
        if self.compare_labels and len(self.compare_labels) != len(self.compare_attribute_runs):
            raise MistillInputError(f"compare_labels names {len(self.compare_labels)} runs, "
                                    f"compare_attribute_runs {len(self.compare_attribute_runs)}",
                                    field="compare_labels")
        check_run_ids(self.replicate_runs, "replicate_runs")
        parse_replicate_pairs(self.replicate_runs)
        bounds = list(self.layer_blocks)
        if any(not 0 < b < 1 for b in bounds) or bounds != sorted(set(bounds)):
            raise MistillInputError(f"layer_blocks must be increasing fractions in (0, 1), got "
                                    f"{bounds}", field="layer_blocks")

    def content_digests(self) -> dict[str, str]:
        """The audit labels file's content (an edited file makes a new report)."""
        digest = file_digest(self.audit_labels)
        return {"audit_labels": digest} if digest else {}

    def choices(self):
        """The table choices :func:`analysis.report.build_report` takes."""
        return TableChoices(importance_heads=self.importance_heads, profile_k=self.profile_k,
                            layer_blocks=tuple(self.layer_blocks), ce_steps=tuple(self.ce_steps),
                            sign_alpha=self.sign_alpha)


def run_report(cfg: ReportConfig) -> str:
    """Build and log the report; returns the report run's id (an identical one is reused)."""
    uri = resolve_tracking_uri(mistill_root())
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(tracking_uri=uri)
    experiment = experiment_for_corpus(cfg.corpus, tracking_uri=uri)
    inputs = collect_inputs(client, experiment, arms=cfg.arms, reference_arm=cfg.reference_arm, split=cfg.split,
                            own_heads_split=cfg.own_heads_split, compare_attribute_runs=cfg.compare_attribute_runs, compare_labels=cfg.compare_labels)
    guard = PrivacyGuard([], inputs.privacy())
    with StageRun("report", cfg, corpus=cfg.corpus, guard=guard, inputs=inputs.lineage(),
                  description=stage_help()["report"],
                  resume=True, root=mistill_root(), tracking_uri=uri) as run:
        if run.reused:
            print(f"report: reusing finished run {run.run_id}")
            return run.run_id
        labels = None
        if cfg.audit_labels:
            labels = read_audit_labels(cfg.audit_labels)
        rep = build_report(inputs, reference_arm=cfg.reference_arm, n_resamples=cfg.bootstrap,
                           corpus_resamples=cfg.corpus_bootstrap, seed=cfg.seed,
                           choices=cfg.choices(), split=cfg.split, client=client, audit_labels=labels,
                           replicate_pairs=parse_replicate_pairs(cfg.replicate_runs))
        tables_dir = run.work_dir / "artifacts" / "tables"
        for t in rep.tables:
            run.log_table(f"tables/{t.name}", t.numeric)
            for suffix, text in (("_display.md", to_markdown(t.display)),
                                 (".tex", to_latex(t.display))):
                path = tables_dir / f"{t.name}{suffix}"
                write_text(path, text)
                run.log_artifact_file(path, "tables")
        for name, fig in rep.figures.items():
            run.log_figure(fig, f"figures/{name}")
        run.log_json("deviations.json", rep.deviations_json())
        checked, _ = verify_store(client, experiment)  # the verify stage's table, as a report section
        run.log_table("tables/verify", checked, index=False)
        report_path = run.work_dir / "artifacts" / "report.md"
        write_text(report_path, rep.markdown() + "\n" + verify_markdown(checked, heading="##"))
        run.log_artifact_file(report_path)
        run.log_metrics({**{f"n_runs/{s}": n for s, n in rep.counts.items()},
                         "n_tables": len(rep.tables), "n_figures": len(rep.figures),
                         "n_notes": len(rep.notes), "n_deviations": len(rep.deviations),
                         "n_deviation_tags": len(rep.deviation_tags)})
        print(f"report: {len(rep.tables)} tables, {len(rep.figures)} figures, "
              f"{len(rep.notes)} notes ({experiment.removeprefix(EXPERIMENT_PREFIX)}) "
              f"-> run {run.run_id}")
        return run.run_id
