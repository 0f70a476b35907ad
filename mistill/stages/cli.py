"""Command line of the entry point scripts: ``--name value`` pairs into the stage's config."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from mistill.errors import MistillInputError, TrackingUnavailableError
from mistill.tracking.lease import LeaseError
from mistill.tracking.privacy import PrivacyError
from mistill.tracking.purge import RunNotPurgedError
from mistill.validation import TextValueError


def parse_args(argv: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise MistillInputError(f"expected --name value, got {arg!r}", field="argv")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv):
                raise MistillInputError(f"--{key} needs a value", field=key)
            value = argv[i + 1]
            i += 1
        out[key.replace("-", "_")] = value
        i += 1
    return out


def main(stage_name: str, argv: Sequence[str] | None = None) -> str:
    """Run one entry point; prints and returns the run id.

    Exits with code 2 on bad input, 3 when the tracking server cannot be reached (the run is
    left as it was: rerunning the same command resumes it), 4 when an identical run is held by
    another live process and waiting was refused; the message goes to stderr. Under
    ``mlflow run``, a run that ``mlflow run`` opened but the stage never adopted (refused input,
    a refused busy run) is ended and deleted, so a refusal leaves no run behind. When the refusal
    is of text (protected note text, :class:`~mistill.tracking.privacy.PrivacyError`, or a
    parameter shaped like text, :class:`~mistill.validation.TextValueError`), that run, which
    holds the ``-P`` values as params, is purged from the tracking store instead
    (:func:`purge_launched_run`).
    """
    from mistill.stages.registry import stages
    from mistill.tracking.connection import configure_client_timeouts, tracking_errors

    stage = stages()[stage_name]
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.pop("help", None) is not None:
        print(f"{stage.name}: {stage.help}\nparameters: {stage.config().to_dict()}")
        return ""
    try:
        configure_client_timeouts()
        with tracking_errors():
            cfg = stage.config.from_dict(args, source=f"entry point {stage_name}")
            cfg.check_environment()
            run_id = stage.run(cfg)
    except PrivacyError as exc:
        print(f"mistill {stage_name}: {exc}", file=sys.stderr)
        if not isinstance(exc, RunNotPurgedError):  # that one says what is left to do
            purge_launched_run(stage_name)
        raise SystemExit(2) from None
    except MistillInputError as exc:
        print(f"mistill {stage_name}: {exc}", file=sys.stderr)
        if isinstance(exc, TextValueError):
            purge_launched_run(stage_name)
        else:
            discard_launched_run()
        raise SystemExit(2) from None
    except LeaseError as exc:
        print(f"mistill {stage_name}: {exc}", file=sys.stderr)
        discard_launched_run()
        raise SystemExit(4) from None
    except TrackingUnavailableError as exc:
        print(f"mistill {stage_name}: {exc}", file=sys.stderr)
        raise SystemExit(3) from None
    print(f"mistill {stage_name}: run {run_id}")
    return run_id


def discard_launched_run() -> None:
    """Have the run ``mlflow run`` opened for this process (``MLFLOW_RUN_ID``) deleted once
    ``mlflow run`` has ended it, when no stage adopted it (it carries no ``mistill.stage`` tag):
    a refusal leaves no empty FAILED run (:mod:`mistill.tracking.reaper`)."""
    import os

    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from mistill.tracking.reaper import spawn_reaper
    from mistill.tracking.runs import TAG_STAGE

    launched = os.environ.get("MLFLOW_RUN_ID")
    if not launched:
        return
    try:
        client = MlflowClient()
        if TAG_STAGE in client.get_run(launched).data.tags:
            return
        spawn_reaper(launched, client.tracking_uri)
    except MlflowException:
        return


def purge_launched_run(stage_name: str) -> None:
    """Purge the run ``mlflow run`` opened for this process (``MLFLOW_RUN_ID``) from the tracking
    store, when no stage adopted it (it carries no ``mistill.stage`` tag).

    Called when the stage refused text: such a run holds only what ``mlflow run`` stored, the
    ``-P`` values the refused one came from, so deleting it is not enough. A run a stage adopted
    passed the privacy guard before adoption (:class:`~mistill.tracking.runs.StageRun`), and a
    run already purged (by the stage) is gone. Says on stderr what was done, or the
    ``mlflow gc`` command an operator must run (:func:`mistill.tracking.purge.purge_run`).
    """
    import os
    import shlex

    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from mistill.stages.common import mistill_root
    from mistill.tracking.purge import gc_command, purge_run
    from mistill.tracking.runs import TAG_STAGE

    launched = os.environ.get("MLFLOW_RUN_ID")
    if not launched:
        return
    client = MlflowClient()
    try:
        if TAG_STAGE in client.get_run(launched).data.tags:
            return
        purge_run(launched, tracking_uri=client.tracking_uri, root=mistill_root())
    except RunNotPurgedError as exc:
        print(f"mistill {stage_name}: {exc}", file=sys.stderr)
        return
    except MlflowException as exc:
        if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
            return
        print(f"mistill {stage_name}: run {launched} that `mlflow run` opened holds the refused value, and "
              f"could not be purged ({type(exc).__name__}); delete it, then run: "
              f"{shlex.join(gc_command(launched, client.tracking_uri))}", file=sys.stderr)
        return
    print(f"mistill {stage_name}: run {launched} that `mlflow run` opened held the refused value: it is "
          "deleted and purged from the tracking store", file=sys.stderr)
