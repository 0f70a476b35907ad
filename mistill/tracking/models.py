"""Trained checkpoints as MLflow Models, in the model registry, and as model specs.

**The checkpoint.** A ``train`` run saves its student with ``mlflow.transformers`` (task
``text-generation``, a signature whose parameters default to the paper's sampling with a
512-token cap (pass ``max_new_tokens=16384`` for the paper's cap), an input
example, the tokenizer) into a local folder, has the run's privacy guard read every file of it,
and logs the folder as the run's artifact path ``model``:

* ``model/MLmodel``, ``model/components/tokenizer/``: the MLflow Model, so
  ``mlflow.pyfunc.load_model`` and ``mlflow.transformers.load_model`` open
  ``runs:/<run id>/model`` and ``models:/<name>@<alias>``, and ``mlflow models serve`` serves it;
* ``model/model/``: the Hugging Face checkpoint (``config.json``, weights, and a copy of the
  tokenizer files), what the platform's own stages load.

**Model specs.** ``run:<train run id>`` names the checkpoint a ``train`` run saved: it is read
from the run's local work dir (``$MISTILL_ROOT/work/<run id>/model``) when this machine trained
it, else its ``model`` artifacts are downloaded there once. Every stage that takes a ``model``
accepts such a spec (see :mod:`mistill.models.loading`). Checkpoints logged before the MLflow
Model layout (``model/config.json``) still load.

**The registry.** Every registered ``train`` checkpoint is a version of the registered model
``mistill-<corpus>-<student>``, tagged with its arm, λ for a Mistill arm (``mistill.lambda_p1``,
``mistill.lambda_p2``), seed, precision, teacher model spec and corpus digest, and described by
a short model card (:func:`model_card`). Aliases (letters, digits, ``_`` and ``-`` only, as
MLflow requires):

* ``<arm>-s<seed>`` (the *arm alias*, e.g. ``mistill-s0``): the adopted model of an arm at a
  seed: set by a plain ``train`` run, and by ``select_lambda`` on the pick's version once its
  decision completes; never by a λ-selection cell;
* ``<arm>-l<λ>-s<seed>`` (the *cell alias*, e.g. ``mistill-l0p03-s0``; ``mistill-l0p03-0p1-s0``
  when λ_P1 = 0.03 and λ_P2 = 0.1 differ): the model a λ-selection cell trained. A λ is written
  as Python's ``repr`` of the float with ``.`` spelled ``p``, ``-`` spelled ``m`` and ``+``
  dropped (``0.03`` -> ``0p03``, ``1e-05`` -> ``1em05``).

A ``train`` run learns it is a selection cell from ``$MISTILL_TRAIN_ROLE`` (:data:`ENV_ROLE`,
set by the selection's runner around the cells it launches, in this process and the ones it
starts): the role decides only which alias the version gets, not what is trained, so it is no
part of the run's identity, and a cell's run is reused by an identical plain ``train`` (whose
arm alias the selection's pick then carries).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Iterator, Mapping
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from mistill.distill.arms import is_arm_path
from mistill.errors import MistillInputError
from mistill.evaluation.generation import DecodingConfig
from mistill.io import mistill_root
from mistill.tracking.connection import is_unreachable

RUN_PREFIX = "run:"
MODEL_ARTIFACT = "model"
"""The artifact path of a ``train`` run's checkpoint (an MLflow Model)."""
HF_SUBDIR = "model"
"""The Hugging Face checkpoint inside the MLflow Model folder (``mlflow.transformers``'s
``model_binary``)."""
MLMODEL = "MLmodel"
HF_MARKER = "config.json"
TASK = "text-generation"
INPUT_EXAMPLE = "List the ICD-10-CM codes this discharge summary supports."
"""The logged model's input example: a fixed instruction, never corpus text."""
TAG_LOGGED_MODELS = "mlflow.log-model.history"
"""The run tag the MLflow UI's Models column reads."""

ENV_ROLE = "MISTILL_TRAIN_ROLE"
ROLE_ARM = "arm"
ROLE_CELL = "selection-cell"
ROLES = (ROLE_ARM, ROLE_CELL)

TAG_REGISTERED_MODEL = "mistill.registered_model"
TAG_MODEL_VERSION = "mistill.model_version"
TAG_MODEL_ALIAS = "mistill.model_alias"
TAG_MODEL_ROLE = "mistill.model_role"


# ----------------------------------------------------------------------------- model specs
def run_artifact_dir(run_id: str, artifact_path: str, *, stage: str, marker: str | tuple[str, ...],
                     field: str) -> Path:
    """Local copy of the directory ``artifact_path`` that a ``stage`` run logged.

    It lives at ``$MISTILL_ROOT/work/<run id>/<artifact_path>``: the run's own work dir when this
    machine ran it (recognised by its ``marker`` file, or one of several), else the artifacts are
    downloaded there once (into a temporary directory, then renamed, so nothing half-written is
    left). Errors name ``field``: a missing run, a run of another stage, artifacts absent or
    without ``marker``.
    """
    from mlflow.tracking import MlflowClient  # deferred: mlflow.tracking is slow to import

    markers = (marker,) if isinstance(marker, str) else tuple(marker)
    local = mistill_root() / "work" / run_id / artifact_path
    if any((local / m).exists() for m in markers):
        return local.resolve()
    client = MlflowClient()
    try:
        run = client.get_run(run_id)
    except Exception as exc:  # noqa: BLE001 - MLflow raises several types for a missing run
        raise MistillInputError(f"no run {run_id!r} on the tracking server ({exc.__class__.__name__})",
                                field=field) from None
    if run.data.tags.get("mistill.stage") != stage:
        raise MistillInputError(f"run {run_id} is a {run.data.tags.get('mistill.stage')!r} run, not a {stage} run",
                                field=field)
    local.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=local.parent, prefix=f".dl-{artifact_path}-") as tmp:
        try:
            got = client.download_artifacts(run_id, artifact_path, tmp)
        except Exception:  # noqa: BLE001
            raise MistillInputError(f"{stage} run {run_id} logged no {artifact_path} artifacts", field=field) from None
        if not any((Path(got) / m).exists() for m in markers):
            raise MistillInputError(f"the {artifact_path} artifacts of run {run_id} hold no {' or '.join(markers)}",
                                    field=field)
        if local.exists():
            shutil.rmtree(local)
        os.replace(got, local)
    return local.resolve()


def checkpoint_dir(model_dir: Path) -> Path:
    """The Hugging Face checkpoint inside a logged ``model`` folder: ``model/`` of an MLflow Model
    (``MLmodel`` present), else the folder itself (the layout before MLflow Models)."""
    return model_dir / HF_SUBDIR if (model_dir / MLMODEL).exists() else model_dir


def trained_model_dir(run_id: str) -> Path:
    """Local directory of the checkpoint logged by ``train`` run ``run_id`` (``config.json`` and
    the tokenizer inside)."""
    local = run_artifact_dir(run_id, MODEL_ARTIFACT, stage="train", marker=(MLMODEL, HF_MARKER), field="model")
    return checkpoint_dir(local)


def resolve_run_spec(spec: str) -> str:
    """``run:<id>[@layers]`` -> the checkpoint's local path (other specs unchanged)."""
    if not spec.startswith(RUN_PREFIX):
        return spec
    return str(trained_model_dir(spec[len(RUN_PREFIX):]))


# ------------------------------------------------------------------------- the MLflow Model
def pip_requirements() -> list[str]:
    """What serving the logged model needs, pinned to the versions installed here (a local
    version label such as ``+cpu`` dropped, so the pins install from PyPI)."""
    out = []
    for package in ("mlflow", "torch", "transformers", "tokenizers", "safetensors", "accelerate"):
        try:
            out.append(f"{package}=={version(package).split('+')[0]}")
        except PackageNotFoundError:
            continue
    return out


SERVING_MAX_NEW_TOKENS = 512
"""The logged model's default ``max_new_tokens``: a cap a CPU answers in reasonable time. The
paper's cap (16,384, :class:`~mistill.evaluation.generation.DecodingConfig`) is the parameter to
pass to reproduce its decoding: ``predict(..., params={"max_new_tokens": 16384})``."""


def signature() -> Any:
    """Text in, text out; the generation parameters default to the paper's sampling
    (:class:`~mistill.evaluation.generation.DecodingConfig`: sampled, temperature 0.6, top-p
    0.95, top-k 20) with at most :data:`SERVING_MAX_NEW_TOKENS` (512) new tokens, not the
    paper's 16,384: a reasoning trace of that length takes hours on a CPU, where a served model
    or a quick ``predict`` often runs. Pass ``params={"max_new_tokens": 16384}`` for the
    paper's cap."""
    from mlflow.models.signature import ModelSignature  # deferred: mlflow.models.signature is slow to import
    # deferred: mlflow.types is slow to import
    from mlflow.types import ColSpec, DataType, ParamSchema, ParamSpec, Schema

    d = DecodingConfig()
    params = ParamSchema([ParamSpec("max_new_tokens", DataType.long, SERVING_MAX_NEW_TOKENS),
                          ParamSpec("do_sample", DataType.boolean, True),
                          ParamSpec("temperature", DataType.double, d.temperature),
                          ParamSpec("top_p", DataType.double, d.top_p),
                          ParamSpec("top_k", DataType.long, d.top_k)])
    return ModelSignature(inputs=Schema([ColSpec(DataType.string)]), outputs=Schema([ColSpec(DataType.string)]),
                          params=params)


def save_mlflow_model(model: Any, tokenizer: Any, path: Path, *, card: str, source: str) -> Any:
    """Save ``model`` and ``tokenizer`` as an MLflow Model (``mlflow.transformers``) at ``path``
    (replaced if present), with ``card`` as its model card and ``source`` (a model spec) as its
    source model name; the tokenizer files are copied beside the weights too, so ``path/model``
    is a whole Hugging Face checkpoint. Returns the :class:`mlflow.models.Model`. Nothing leaves
    this machine."""
    import mlflow.transformers  # deferred: mlflow.transformers is slow to import
    from huggingface_hub import ModelCard  # deferred: huggingface_hub is slow to import
    from mlflow.models import Model  # deferred: mlflow.models is slow to import

    path = Path(path)
    if path.exists():
        shutil.rmtree(path)
    saved_name = model.config._name_or_path
    model.config._name_or_path = source  # no local path in MLmodel; the hub is not asked for a card
    try:
        mlflow.transformers.save_model({"model": model, "tokenizer": tokenizer}, str(path), task=TASK,
                                       signature=signature(), input_example=INPUT_EXAMPLE,
                                       pip_requirements=pip_requirements(),
                                       model_card=ModelCard(f"---\n{_card_data().to_yaml()}\n---\n\n{card}\n"))
    finally:
        model.config._name_or_path = saved_name
    tokenizer.save_pretrained(path / HF_SUBDIR)
    return Model.load(str(path / MLMODEL))


def _card_data() -> Any:
    """The model card's metadata block."""
    from huggingface_hub import ModelCardData  # deferred: huggingface_hub is slow to import

    return ModelCardData(library_name="transformers", pipeline_tag=TASK, tags=["mistill", "distillation"])


def logged_model_tag(mlflow_model: Any, run_id: str, artifact_path: str = MODEL_ARTIFACT) -> str:
    """The value of :data:`TAG_LOGGED_MODELS` for one model logged at ``artifact_path``."""
    mlflow_model.run_id = run_id
    mlflow_model.artifact_path = artifact_path
    return json.dumps([mlflow_model.get_tags_dict()])


# -------------------------------------------------------------------------------- aliases
def alias_part(text: str) -> str:
    """``text`` with every run of characters an alias may not hold replaced by ``-``."""
    return re.sub(r"[^A-Za-z0-9_-]+", "-", text).strip("-")


def arm_label(arm: str) -> str:
    """The arm's name in an alias: a bare arm name as it is, an arm file by its stem."""
    return alias_part(Path(arm).stem if is_arm_path(arm) else arm)


def lambda_alias(value: float) -> str:
    """A λ as an alias part: ``repr`` with ``.`` -> ``p``, ``-`` -> ``m``, ``+`` dropped."""
    return repr(float(value)).replace(".", "p").replace("-", "m").replace("+", "")


def arm_alias(arm: str, seed: int) -> str:
    """``<arm>-s<seed>``: the adopted model of an arm at a seed."""
    return f"{arm_label(arm)}-s{seed}"


def cell_alias(arm: str, lambda_p1: float, lambda_p2: float, seed: int) -> str:
    """``<arm>-l<λ>-s<seed>`` (tied λ) or ``<arm>-l<λ_P1>-<λ_P2>-s<seed>``: a λ-selection cell."""
    lams = lambda_alias(lambda_p1) if lambda_p1 == lambda_p2 else \
        f"{lambda_alias(lambda_p1)}-{lambda_alias(lambda_p2)}"
    return f"{arm_label(arm)}-l{lams}-s{seed}"


def train_role() -> str:
    """The role of a ``train`` run started here: :data:`ROLE_CELL` inside
    :func:`selection_cells`, else :data:`ROLE_ARM`."""
    role = os.environ.get(ENV_ROLE) or ROLE_ARM
    if role not in ROLES:
        raise MistillInputError(f"{ENV_ROLE}={role!r}; use one of {list(ROLES)}", field=ENV_ROLE)
    return role


_role_lock = threading.Lock()
_role_depth = 0
_role_saved: str | None = None


@contextlib.contextmanager
def selection_cells() -> Iterator[None]:
    """``train`` runs started inside (in this process, any thread, or the processes it launches)
    are λ-selection cells: their versions get the cell alias, never the arm alias. Nests; the
    variable is restored when the last block exits."""
    global _role_depth, _role_saved
    with _role_lock:
        if _role_depth == 0:
            _role_saved = os.environ.get(ENV_ROLE)
            os.environ[ENV_ROLE] = ROLE_CELL
        _role_depth += 1
    try:
        yield
    finally:
        with _role_lock:
            _role_depth -= 1
            if _role_depth == 0:
                if _role_saved is None:
                    os.environ.pop(ENV_ROLE, None)
                else:
                    os.environ[ENV_ROLE] = _role_saved


# ------------------------------------------------------------------------------- registry
def registered_model_name(corpus: str, model: str) -> str:
    """``mistill-<corpus>-<student spec>``, made a valid registered-model name."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", f"mistill-{corpus}-{model}").strip("-")


def register_version(client: Any, name: str, run_id: str, *, tags: Mapping[str, str], description: str,
                     artifact_path: str = MODEL_ARTIFACT) -> Any:
    """A new version of registered model ``name`` (created when missing) from
    ``runs:/<run_id>/<artifact_path>``, with ``tags`` and ``description``."""
    from mlflow.exceptions import MlflowException  # deferred: mlflow.exceptions is slow to import

    try:
        client.get_registered_model(name)
    except MlflowException:
        with contextlib.suppress(MlflowException):  # created concurrently by another run
            client.create_registered_model(name, description="Students trained by mistill, one version per "
                                                             "train run; see each version's description.")
    return client.create_model_version(name, source=f"runs:/{run_id}/{artifact_path}", run_id=run_id,
                                       tags=dict(tags), description=description)


def adopt(client: Any, train_run_id: str, alias: str) -> tuple[str, str] | None:
    """Point ``alias`` at the registered version of ``train_run_id``'s checkpoint; returns
    ``(name, version)``, or None when that run registered none (or is not on the server)."""
    from mlflow.exceptions import MlflowException  # deferred: mlflow.exceptions is slow to import

    try:
        tags = client.get_run(train_run_id).data.tags
    except MlflowException as exc:
        if is_unreachable(exc):
            raise
        return None
    name, version = tags.get(TAG_REGISTERED_MODEL), tags.get(TAG_MODEL_VERSION)
    if not name or not version:
        return None
    client.set_registered_model_alias(name, alias, version)
    return name, version


# --------------------------------------------------------------------------- logged models
TAG_TRAIN_RUN = "mistill.train_run"
"""The tag of a checkpoint's logged model naming the ``train`` run that saved it."""
TAG_MODEL_URI = "mistill.model_uri"
"""The tag of a checkpoint's logged model holding the checkpoint's URI, ``runs:/<id>/model``."""


def checkpoint_logged_model(client: Any, train_run_id: str, *, params: Mapping[str, str] | None = None) -> str:
    """The id of the logged model (MLflow 3's ``LoggedModel``) that stands for the checkpoint
    ``train_run_id`` saved, created the first time a run asks for it.

    It is found by its :data:`TAG_TRAIN_RUN` tag (the oldest one when concurrent first readers
    made two). A new one lives in the train run's experiment, is named by the arm alias
    (``<arm>-s<seed>``), has the train run as its source run and its output, carries the train
    run's arm, seed, precision and registry tags, :data:`TAG_MODEL_URI`, and ``params`` (the
    arm's flags), and is READY. The weights stay where the train run logged them.
    """
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus  # deferred: mlflow.entities is slow to import

    run = client.get_run(train_run_id)
    experiment = run.info.experiment_id
    found = client.search_logged_models([experiment], filter_string=f"tags.`{TAG_TRAIN_RUN}` = '{train_run_id}'",
                                        order_by=[{"field_name": "creation_time", "ascending": True}],
                                        max_results=1)
    if found:
        return found[0].model_id
    tags = run.data.tags
    copied = ("mistill.arm", "mistill.seed", "mistill.precision", "mistill.lambda", "mistill.corpus",
              TAG_REGISTERED_MODEL, TAG_MODEL_VERSION, TAG_MODEL_ALIAS)
    model_tags = {k: tags[k] for k in copied if tags.get(k)}
    model_tags.update({TAG_TRAIN_RUN: train_run_id, TAG_MODEL_URI: f"runs:/{train_run_id}/{MODEL_ARTIFACT}"})
    seed = tags.get("mistill.seed", "")
    name = arm_alias(tags["mistill.arm"], seed) if tags.get("mistill.arm") else alias_part(f"train-{train_run_id}")
    model = client.create_logged_model(experiment, name=name, source_run_id=train_run_id, tags=model_tags,
                                       params=dict(params or {}), model_type=TASK)
    client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
    client.log_outputs(train_run_id, [LoggedModelOutput(model.model_id, step=0)])
    return model.model_id


def model_card(*, name: str, arm: str, arm_flags: Mapping[str, Any], seed: int, precision: str, role: str,
               alias: str, student: str, teacher: str, corpus: str, corpus_digest: str, n_notes: int,
               recipe: Mapping[str, Any], steps: int, run_id: str, inputs: Mapping[str, str]) -> str:
    """A short Markdown model card: what was trained (arm, λ, seed, precision), on what data,
    with which recipe, by which run, and how to load it."""
    lam = (f", λ_P1 = {arm_flags.get('lambda_p1')!r}, λ_P2 = {arm_flags.get('lambda_p2')!r}"
           if arm_flags.get("objective") == "mistill" else "")
    what = ("a λ-selection cell (it gets the arm alias only if the selection picks it)" if role == ROLE_CELL
            else "a trained arm")
    lines = [
        f"**{arm}**, seed {seed}, {precision}: {what}; alias at registration `{alias}`.",
        "",
        f"- Arm: `{arm}` (objective `{arm_flags.get('objective')}`){lam}; every flag is a param "
        f"`arm.<flag>` of the train run.",
        f"- Student: `{student}`, distilled from the teacher `{teacher}`.",
        f"- Data: corpus `{corpus}` (digest `{corpus_digest}`), {n_notes} training notes; "
        + ", ".join(f"{k} run `{v}`" for k, v in sorted(inputs.items())) + ".",
        "- Recipe: " + ", ".join(f"{k} {v}" for k, v in recipe.items()) + f"; {steps} optimizer steps.",
        f"- Train run: `{run_id}`.",
        f"- Load: `mlflow.pyfunc.load_model(\"models:/{name}@{alias}\")` or "
        f"`mlflow.transformers.load_model(...)` (text generation; parameters default to the paper's "
        f"sampling with at most {SERVING_MAX_NEW_TOKENS} new tokens: pass `max_new_tokens=16384` for the "
        f"paper's cap); in mistill stages, the model spec `run:{run_id}`.",
    ]
    return "\n".join(lines)
