"""Every MLflow entry point: its config class, its run function, and its input runs.

``MLproject`` is generated from this table (``python -m mistill.stages.mlproject``), so the
entry points, their typed parameters and their defaults cannot drift from the code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mistill.config import Config


@dataclass(frozen=True)
class Stage:
    """One entry point. ``inputs`` maps a lineage name to the config field holding that run id."""

    name: str
    config: type[Config]
    run: Callable[[Config], str]
    inputs: dict[str, str]
    help: str

    def input_runs(self, cfg: Config) -> dict[str, str]:
        """Lineage of a config: the input runs it names (optional inputs left empty are omitted)."""
        return {name: getattr(cfg, field) for name, field in self.inputs.items() if getattr(cfg, field)}


def stages() -> dict[str, Stage]:
    from mistill.stages.characterize import (AttributeConfig, EventsConfig, KnockinStageConfig,
                                             run_attribute, run_events, run_knockin)
    from mistill.stages.distill import TargetsConfig, TrainStageConfig, run_targets, run_train
    from mistill.stages.evaluate import EvaluateConfig, run_evaluate
    from mistill.stages.generate import GenerateConfig, run_generate
    from mistill.stages.own_heads import OwnHeadsConfig, run_own_heads
    from mistill.stages.prepare import PrepareConfig, run_prepare
    from mistill.stages.report import ReportConfig, run_report
    from mistill.stages.select_lambda import SelectLambdaConfig, run_select_lambda
    from mistill.stages.shortlist import ShortlistConfig, run_shortlist
    from mistill.stages.las import LasSimulatorConfig, run_las_simulator
    from mistill.stages.workflow import (CharacterizeConfig, PipelineConfig, run_characterize,
                                         run_pipeline)

    table = [
        Stage("prepare", PrepareConfig, run_prepare, {}, "inventory, corpus and prompts"),
        Stage("shortlist", ShortlistConfig, run_shortlist, {"prepare": "prepare_run"},
              "the retrieved shortlist: a prepared corpus whose prompts list it (use as prepare_run)"),
        Stage("generate", GenerateConfig, run_generate, {"prepare": "prepare_run"},
              "a model's traces under the paper's decoding: flags, rates, a traced corpus (use as prepare_run)"),
        Stage("events", EventsConfig, run_events, {"prepare": "prepare_run"},
              "decision events per note, realized in the model's tokenizer, and the margin audit"),
        Stage("attribute", AttributeConfig, run_attribute, {"events": "events_run"},
              "attribution pass, exact patches, calibration and global head sets"),
        Stage("knockin", KnockinStageConfig, run_knockin, {"attribute": "attribute_run"},
              "necessity and knock-in of the global sets against controls"),
        Stage("targets", TargetsConfig, run_targets, {"teacher_attribute": "teacher_attribute_run"},
              "the teacher's targets on the training notes: top-32, pooled bucket rows, m and c"),
        Stage("train", TrainStageConfig, run_train,
              {"targets": "targets_run", "student_attribute": "student_attribute_run"},
              "one arm at one seed with the shared recipe; the checkpoint registered per arm and seed"),
        Stage("evaluate", EvaluateConfig, run_evaluate,
              {"prepare": "prepare_run", "train": "train_run", "las": "las_run"},
              "a model or trained arm on a split: predictions, task metrics, fidelity (PPL, BLEU-4, LAS), M1"),
        Stage("las_simulator", LasSimulatorConfig, run_las_simulator, {"prepare": "prepare_run"},
              "the frozen LAS simulator: fine-tuned once on the teacher's traces (note + rationale, note alone)"),
        Stage("own_heads", OwnHeadsConfig, run_own_heads, {"prepare": "prepare_run", "train": "train_run"},
              "mechanism readouts on an arm's own heads (M4 knock-in and floors, M2, M3, prefix share; own traces)"),
        Stage("select_lambda", SelectLambdaConfig, run_select_lambda,
              {"prepare": "prepare_run", "targets": "targets_run", "student_attribute": "student_attribute_run"},
              "pre-registered λ selection: a locked grid on Optuna, each cell trained and evaluated once"),
        Stage("characterize", CharacterizeConfig, run_characterize, {"prepare": "prepare_run"},
              "events -> attribute -> knockin, reusing identical finished runs"),
        Stage("pipeline", PipelineConfig, run_pipeline, {},
              "the whole platform on one corpus: prepare, then every stage that exists"),
        Stage("report", ReportConfig, run_report, {},
              "the paper's tables and figures from the tracking store, paired note-level tests"),
    ]
    return {s.name: s for s in table}
