"""What a stage run is called and tagged: the names that conventions fix in the store.

* Every run carries the tags below (``mistill.stage``, ``mistill.model``, ...), lineage tags
  ``mistill.input.<name> = <input run id>``, all params of its :class:`~mistill.config.Config`,
  and a ``config.json`` artifact (:data:`CONFIG_ARTIFACT`) with every argument, the code version
  and the git commit.
* A run's name says what it is, arm, λ and seed first, then stage, model and split
  (:func:`run_name`), never a run id.
* A metric name joins its parts with ``/`` (:func:`metric_name`), never ``.``.
* A finished note's marker is ``_DONE`` (:data:`DONE_MARKER`, see :mod:`mistill.tracking.notes`).

Nothing here imports MLflow.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mistill.errors import MistillInputError
from mistill.io import is_safe_name

# ---------------------------------------------------------------------------------------- tags
TAG_STAGE = "mistill.stage"
TAG_MODEL = "mistill.model"
TAG_CORPUS = "mistill.corpus"
TAG_CORPUS_DIGEST = "mistill.corpus_digest"
TAG_PRIVACY = "mistill.privacy"
TAG_ARM = "mistill.arm"
TAG_SEED = "mistill.seed"
TAG_PRECISION = "mistill.precision"
TAG_SPLIT = "mistill.split"  # the notes a readout ran on (evaluate, own_heads)
TAG_BACKEND = "mistill.backend"  # the backend that sampled a readout's generations (hf or vllm)
TAG_GIT_COMMIT = "mistill.git_commit"
TAG_CODE_VERSION = "mistill.code_version"
TAG_ENTRY_POINT = "mistill.entry_point"
TAG_PARAMS_DIGEST = "mistill.params_digest"
TAG_INPUT_PREFIX = "mistill.input."
"""Lineage: ``mistill.input.<name>`` = the run id of the input run called ``<name>``."""
TAG_DELEGATED_TO = "mistill.delegated_to"
"""Set on a run launched by ``mlflow run`` when the work was reused/resumed in another run."""
TAG_LAMBDA = "mistill.lambda"
"""The λ a run trained (or read a model trained) with: ``<λ>`` or ``<λ_P1>,<λ_P2>``."""
TAG_PARENT_RUN = "mlflow.parentRunId"
TAG_EXPERIMENT_KIND = "mlflow.experimentKind"
TAG_DESCRIPTION = "mlflow.note.content"
"""The description the MLflow UI shows on a run's and an experiment's page (Markdown)."""
EXPERIMENT_KIND = "custom_model_development"
"""MLflow 3's kind for a classic model-development experiment: its UI opens on the runs table
(an experiment without the tag may open on the GenAI traces page)."""

CONFIG_ARTIFACT = "config.json"
DONE_MARKER = "_DONE"

METRIC_SEPARATOR = "/"
"""Between the parts of a metric name (``fidelity/ppl_median``, ``m1/P2C/p_pos``): MLflow's UI
groups a run's charts by the part before the first ``/``. A metric name holds no ``.``
(:meth:`~mistill.tracking.runs.StageRun.log_metrics` refuses one); params and tags keep their dotted names."""


# -------------------------------------------------------------------------------- run names
CHECKPOINT_PREFIX = "run:"
_RUN_ID = re.compile(r"[0-9a-f]{32}")


def short_model(model: str | None) -> str | None:
    """A model spec as a run name shows it: ``embedded:smollm2-135m`` -> ``smollm2-135m``,
    ``tiny:qwen3:seed=2`` -> ``tiny-qwen3:seed=2``, ``org/Name`` or a path -> ``Name``
    (``.gguf`` dropped); None for a train run's checkpoint (``run:<id>``: the arm names it)."""
    if not model or str(model).startswith(CHECKPOINT_PREFIX):
        return None
    spec = str(model)
    if spec.startswith("embedded:"):
        return spec[len("embedded:"):] or None
    if spec.startswith("tiny:"):
        return "tiny-" + spec[len("tiny:"):]
    path = spec.partition("::")[0].rstrip("/")
    return Path(path).name.removesuffix(".gguf") or None


def lambda_label(lam: Any) -> str | None:
    """λ as a name part or tag value: ``0.03``, or ``0.03,0.1`` when λ_P1 and λ_P2 differ;
    None for no λ. ``lam``: a number, a pair ``(λ_P1, λ_P2)`` or a string already so written."""
    if lam is None or lam == "":
        return None
    if isinstance(lam, str):
        return lam
    if isinstance(lam, (list, tuple)):
        values = list(dict.fromkeys(format(float(v), "g") for v in lam))
        return ",".join(values) or None
    return format(float(lam), "g")


def experiment_description(corpus: str) -> str:
    """What an experiment ``mistill/<corpus>`` holds (Markdown, for its page in the UI)."""
    return (f"The mistill runs on the corpus `{corpus}`: one run per stage and configuration (tag `mistill.stage`), "
            "reused when an identical run has finished. A `pipeline` or `reproduce` run nests the steps it ran; "
            "a `report` run holds the tables (`report.md`, `tables/`) and figures (`figures/`) of the runs it read. "
            "Each run's page says what it computed; `config.json` holds every parameter.")


def run_description(stage: str, what: str, fields: Mapping[str, Any], inputs: Mapping[str, str]) -> str:
    """What a run of ``stage`` computed (Markdown, for its page in the UI): ``what``, the
    identifying ``fields`` that are set (corpus, model, arm, ...) and the input runs."""
    lines = [f"**{stage}**: {what}." if what else f"**{stage}**"]
    shown = [f"{k} `{v}`" for k, v in fields.items() if v not in (None, "")]
    if shown:
        lines.append("; ".join(shown) + ".")
    if inputs:
        lines.append("Reads " + ", ".join(f"{k} run `{v}`" for k, v in inputs.items()) + ".")
    lines.append("Every parameter: `config.json`.")
    return "\n\n".join(lines)


def run_name(stage: str, model: str | None = None, arm: str | None = None,
             seed: int | str | None = None, *, lam: Any = None, split: str | None = None,
             notes: int | None = None) -> str:
    """What the run is, the parts a reader compares first leading (the UI cuts long names):
    ``<arm> λ<λ> s<seed> · <stage> · <model> · <split>`` for a run of an arm (``mistill λ0.03 s0 ·
    evaluate · smollm2-135m · test``), else ``<stage> · <model> · <split> · s<seed>``; parts that
    are None or empty are left out; ``model`` as :func:`short_model` shows it. ``notes``: a
    training run on part of the training notes (the λ selection's cells: ``mistill λ0.01 s0 n100 ·
    train``), so that it is not named like the arm trained on all of them. Never a run id: a
    part that holds one is left out (the run's tags and lineage keep it)."""
    def kept(*parts: Any) -> list[str]:
        return [str(p) for p in parts if p not in (None, "") and not _RUN_ID.search(str(p))]

    label = lambda_label(lam)
    seed_part = f"s{seed}" if seed not in (None, "") else None
    rest = kept(stage, short_model(model), split or None)
    head = kept(arm)
    if head:
        return " · ".join([" ".join(head + kept(f"λ{label}" if label else None, seed_part,
                                                f"n{notes}" if notes else None)), *rest])
    return " · ".join(rest + kept(seed_part))


def metric_name(*parts: Any) -> str:
    """A metric name from its parts, joined by :data:`METRIC_SEPARATOR`; empty parts are left
    out: ``metric_name("m1", "P2C", "p_pos") == "m1/P2C/p_pos"``, ``metric_name("", "m4", "P1")
    == "m4/P1"``. A part may itself be a name so built (``own/m4``).

    Raises:
        MistillInputError: a part holds ``.`` (a dotted name such as a table column
            ``necessity.global`` is split first: ``metric_name("P1", *col.split("."))``).
    """
    names = [str(p) for p in parts if p is not None and str(p) != ""]
    if not names:
        raise MistillInputError("a metric name needs at least one non-empty part", field="metric")
    return check_metric_name(METRIC_SEPARATOR.join(names))


def check_metric_name(name: str) -> str:
    """``name`` if it is a metric name of this project (non-empty, no ``.``: parts are separated
    by ``/``); otherwise a :class:`MistillInputError` that shows the name with ``/``."""
    if not name or "." in name:
        shown = name.replace(".", METRIC_SEPARATOR)
        raise MistillInputError(f"metric name {name!r} holds '.' or is empty: metric names separate "
                                f"their parts with {METRIC_SEPARATOR!r} (write {shown!r}), so MLflow's UI "
                                f"groups their charts", field="metric")
    return name


def _check_component(value: str, what: str) -> str:
    if not is_safe_name(value):
        raise MistillInputError(f"{what} {value!r} is not a safe path component "
                                f"(letters, digits, '_', '.', '-'; not starting with '.')",
                                field=what)
    return value


__all__ = [
    "TAG_STAGE", "TAG_MODEL", "TAG_CORPUS", "TAG_CORPUS_DIGEST", "TAG_PRIVACY", "TAG_ARM",
    "TAG_SEED", "TAG_PRECISION", "TAG_SPLIT", "TAG_BACKEND", "TAG_GIT_COMMIT", "TAG_CODE_VERSION",
    "TAG_ENTRY_POINT", "TAG_PARAMS_DIGEST", "TAG_INPUT_PREFIX", "TAG_DELEGATED_TO", "TAG_LAMBDA",
    "TAG_PARENT_RUN", "TAG_EXPERIMENT_KIND", "TAG_DESCRIPTION", "EXPERIMENT_KIND", "CONFIG_ARTIFACT", "DONE_MARKER",
    "METRIC_SEPARATOR", "CHECKPOINT_PREFIX", "short_model", "lambda_label", "run_name", "metric_name",
    "check_metric_name",
]
