"""Command line of every stage: ``mistill <stage> --name value ...``, ``python projects/<stage>.py``.

The options are generated from the stage's config dataclass (:mod:`mistill.stages.registry`):
one ``--<field>`` per field, whose help gives the field's meaning (read from the config class's
docstring, :func:`field_meanings`), type and default. ``--name value``, ``--name=value`` and
``--name-with-dashes`` are accepted; every value is passed as given to ``Config.from_dict``, which
checks it against the field's type, so a boolean reads ``true``/``false`` as ``mlflow run`` passes
it (``--flag`` alone means ``true``).

Before a run is created the command line refuses, with exit code 2, an unknown option (naming the
closest known one), a value that does not fit its field, and a required input run left empty; it
then makes one request to the tracking server, so an unreachable server is reported (exit code 3)
before the stage loads anything, and checks every input run, model and file the config names
(:func:`mistill.stages.runner.preflight`: a run of the wrong stage, a run that did not finish, a
model directory without ``config.json`` are refused with exit code 2).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import inspect
import os
import re
import shlex
import sys
import textwrap
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from mistill.config import param_fields
from mistill.distributed import current_world, leave_world
from mistill.errors import MistillInputError, TrackingUnavailableError
from mistill.io import mistill_root
from mistill.stages.registry import stage as find_stage, stage_help
from mistill.validation import RUN_ID

if typing.TYPE_CHECKING:
    from mistill.stages.registry import Stage
    from mistill.tracking.privacy import PrivacyGuard

EXIT_INPUT, EXIT_UNREACHABLE, EXIT_BUSY = 2, 3, 4
CLOSE_MATCH = 0.5
"""Least :class:`difflib.SequenceMatcher` ratio at which an unknown option or stage is shown the
known one it is closest to (``n_notez`` -> ``n_notes``: 0.86; ``lambda_p1`` -> ``max_steps``:
0.33, not shown)."""
EXIT_STATUS = ("exit status: 0 done; 2 bad input; 3 tracking server unreachable "
               "(rerun the same command once it is back: the run resumes); 4 an identical run is "
               "held by another live process")


# ----------------------------------------------------------------------- meanings from docstrings
_IDENT = re.compile(r"[a-z_][a-z0-9_]*")
_SEPARATOR = re.compile(r"[ \t]*(?:,|/|and(?=\s))\s*")
_ROLE = re.compile(r":[a-z]+:`(~?)([^`]*)`")
_PARAGRAPH_END = re.compile(r"\n[ \t]*\n")


@dataclasses.dataclass(frozen=True)
class _Label:
    """``name (constraint), other: `` in a docstring: where it starts and ends, what it names."""

    start: int
    end: int
    names: tuple[str, ...]
    constraints: dict[str, str]


def _bracket_end(text: str, i: int) -> int:
    """Index just past the bracketed group that opens at ``text[i]``, or -1 if it never closes.

    ``(`` and ``[`` open, ``)`` and ``]`` close, so that half-open intervals such as
    ``(in (0, 1])`` close where a reader expects."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] in "([":
            depth += 1
        elif text[j] in ")]":
            depth -= 1
            if depth == 0:
                return j + 1
    return -1


def _skip_blanks(text: str, j: int) -> int:
    while j < len(text) and text[j] in " \t":
        j += 1
    return j


def _label_at(text: str, i: int, fields: set[str]) -> _Label | None:
    """The label starting at ``text[i]``, if one does: field names (each optionally in double
    backticks and followed by a bracketed constraint) separated by ``,``, ``/`` or ``and``, then
    ``:`` and a blank. Every name must be a field."""
    names: list[str] = []
    constraints: dict[str, str] = {}
    j = i
    while True:
        ticks = text.startswith("``", j)
        match = _IDENT.match(text, j + 2 if ticks else j)
        if match is None or match.group() not in fields:
            return None
        j = match.end()
        if ticks:
            if not text.startswith("``", j):
                return None
            j += 2
        names.append(match.group())
        k = _skip_blanks(text, j)
        if text.startswith("(", k):
            end = _bracket_end(text, k)
            if end < 0:
                return None
            constraints[match.group()] = " ".join(text[k + 1:end - 1].split())
            j = end
            k = _skip_blanks(text, j)
        if text.startswith(":", k) and (k + 1 == len(text) or text[k + 1].isspace()):
            if len(constraints) == 1 and names[-1] in constraints:  # ``a, b (>= 1):`` bounds both
                constraints = dict.fromkeys(names, constraints[names[-1]])
            return _Label(i, k + 1, tuple(names), constraints)
        sep = _SEPARATOR.match(text, j)
        if sep is None or sep.end() == j:
            return None
        j = sep.end()


def _may_start_label(text: str, i: int) -> bool:
    """A label starts a line, follows ``;`` or ``.`` and a blank, or (in double backticks)
    follows any blank."""
    if text[i] not in "`abcdefghijklmnopqrstuvwxyz_" or (i > 0 and (text[i - 1].isalnum()
                                                                      or text[i - 1] in "_`")):
        return False
    before = text[:i].rstrip(" \t")
    if not before or before.endswith("\n"):
        return True
    if len(before) == i:  # no blank before it
        return False
    return before.endswith((";", ".")) or text[i] == "`"


def _clean(text: str) -> str:
    """Docstring markup to plain text on one line, without a trailing separator."""
    text = _ROLE.sub(lambda m: m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2), text)
    text = text.replace("``", "").replace("**", "")
    return " ".join(text.split()).rstrip(" ;,.")


def field_meanings(cls: type) -> dict[str, str]:
    """What each field of a config class means, from its docstrings: field -> meaning.

    The docstrings describe fields as ``name: meaning``, ``name (constraint): meaning`` or
    ``a, b (constraint), c: shared meaning``, at the start of a line or after ``;`` or ``.``;
    a meaning runs to the next such label or the end of its paragraph. A constraint is appended
    to the meaning in brackets; one after the last of several names, the others having none,
    bounds them all. Every dataclass the class inherits is read too (the parameter groups of
    :mod:`mistill.params` describe their own fields); a class's own description of a field
    wins over a base's. Fields no docstring describes are left out.
    """
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            out.update(_docstring_meanings(klass))
    return out


def _docstring_meanings(cls: type) -> dict[str, str]:
    """The fields described by the docstring of ``cls`` itself (see :func:`field_meanings`)."""
    doc = inspect.cleandoc(vars(cls).get("__doc__") or "")
    body = doc.split("\n", 1)[1] if "\n" in doc else ""
    fields = {f.name for f in dataclasses.fields(cls)}
    labels: list[_Label] = []
    i = 0
    while i < len(body):
        label = _label_at(body, i, fields) if _may_start_label(body, i) else None
        if label is None:
            i += 1
            continue
        labels.append(label)
        i = label.end
    out: dict[str, str] = {}
    for label, following in zip(labels, [*labels[1:], None]):
        text = body[label.end:following.start if following is not None else len(body)]
        meaning = _clean(_PARAGRAPH_END.split(text, 1)[0])
        for name in label.names:
            full = f"{meaning} ({label.constraints[name]})" if name in label.constraints else meaning
            if full:
                out[name] = f"{out[name]}; {full}" if name in out else full
    return out


# ---------------------------------------------------------------------------------- the parser
class _UsageError(Exception):
    """argparse refused the command line (raised instead of exiting, so the stage's message
    and exit code apply)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        raise _UsageError(message)


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Help wrapped at blanks only: a default such as ``embedded:smollm2-135m`` stays whole."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=30, width=100)

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_long_words=False, break_on_hyphens=False)


def param_text(value: Any) -> str:
    """A value as the command line (and ``MLproject``) writes it: ``true``/``false``,
    comma-separated lists, ``''`` for the empty string."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        value = ",".join(str(v) for v in value)
    return str(value) if str(value) else "''"


_TYPE_WORDS = {int: ("INT", "integer"), float: ("FLOAT", "number"), bool: ("BOOL", "true or false"),
               str: ("STR", "string")}


def type_words(annotation: Any) -> tuple[str, str]:
    """``(metavar, description)`` of a field's type: ``("INT", "integer")``,
    ``("INT,...", "comma-separated integers")``."""
    if annotation in _TYPE_WORDS:
        return _TYPE_WORDS[annotation]
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (tuple, list) and args and args[0] in _TYPE_WORDS:
        metavar, word = _TYPE_WORDS[args[0]]
        plural = {"true or false": "booleans"}.get(word, f"{word}s")
        return f"{metavar},...", f"comma-separated {plural}"
    return "VALUE", str(annotation)


def option_help(stage: Stage, name: str, annotation: Any, default: Any, meaning: str) -> str:
    """One option's help: its meaning, what input run it takes, its type and default."""
    parts = [meaning] if meaning else []
    for lineage, f in stage.inputs.items():
        if f == name:
            need = "Optional" if lineage in stage.optional else "Required"
            parts.append(f"{need}: {stage.input_description(lineage)}")
    sentences = [p if p.endswith(".") else f"{p}." for p in parts]
    typed = f"[{type_words(annotation)[1]}; default: {param_text(default)}]"
    return " ".join([*sentences, typed]).replace("%", "%%")  # argparse formats help with %


def stage_parser(stage: Stage, prog: str | None = None) -> argparse.ArgumentParser:
    """The command line of one stage, generated from its config class (its options in the
    order of :func:`~mistill.config.param_fields`)."""
    cls = stage.config
    doc = inspect.cleandoc(cls.__doc__ or "").split("\n\n", 1)[0]
    parser = _Parser(prog=prog or f"mistill {stage.name}", allow_abbrev=False, formatter_class=_Formatter,
                     description=f"{stage.name}: {stage.help}.\n\n{textwrap.fill(' '.join(doc.split()), 96)}",
                     epilog=textwrap.fill(EXIT_STATUS, 96))
    hints = typing.get_type_hints(cls)
    meanings = field_meanings(cls)
    inputs = set(stage.inputs.values())
    for f in param_fields(cls):
        metavar = "RUN_ID" if f.name in inputs else type_words(hints[f.name])[0]
        extra: dict[str, Any] = {"nargs": "?", "const": "true"} if hints[f.name] is bool else {}
        parser.add_argument(f"--{f.name}", metavar=metavar, default=argparse.SUPPRESS,
                            help=option_help(stage, f.name, hints[f.name], f.default, meanings.get(f.name, "")),
                            **extra)
    if stage.shardable:
        group = parser.add_argument_group("processes (not part of the run's identity)")
        group.add_argument("--launcher", choices=LAUNCHERS, default=argparse.SUPPRESS,
                           help="none (default): this process; torchrun / accelerate: `nproc` processes "
                                "started on this node by torch.distributed.run / accelerate launch, "
                                "sharing the notes")
        group.add_argument("--nproc", metavar="INT", default=argparse.SUPPRESS,
                           help="processes of a launch (default: 1), e.g. one per GPU")
    return parser


def _dashes_to_underscores(argv: Sequence[str], names: set[str]) -> list[str]:
    """``--n-notes`` -> ``--n_notes`` where that names a field."""
    out = []
    for arg in argv:
        key, eq, value = arg.partition("=")
        fixed = key.replace("-", "_")
        if key.startswith("--") and key not in names and f"--{fixed[2:]}" in names:
            arg = f"--{fixed[2:]}{eq}{value}"
        out.append(arg)
    return out


def _unknown_error(stage: Stage, extra: Sequence[str]) -> MistillInputError:
    """The error for what argparse left over: unknown options (each with the closest known
    one) or a value that belongs to no option."""
    fields = [f.name for f in dataclasses.fields(stage.config)]
    unknown, stray, after_unknown = [], [], False
    for arg in extra:
        if arg.startswith("-") and arg != "-":
            unknown.append(arg.lstrip("-").partition("=")[0].replace("-", "_"))
            after_unknown = "=" not in arg
        elif after_unknown:
            after_unknown = False  # the unknown option's value
        else:
            stray.append(arg)
    if not unknown:
        return MistillInputError(f"expected --name value, got {stray[0]!r} (`mistill {stage.name} --help` "
                                 "lists the options)", field="argv")
    hints = []
    for name in unknown:
        closest = difflib.get_close_matches(name, fields, n=1, cutoff=CLOSE_MATCH)
        hints.append(f"--{name} is not an option of {stage.name}" + (
            f"; the closest is --{closest[0]}" if closest else "; no option is close to it"))
    return MistillInputError(f"unknown parameter(s) {unknown}: {'; '.join(hints)} (`mistill {stage.name} --help` "
                             "lists the options)", field=unknown[0])


def parse_stage_args(stage: Stage, argv: Sequence[str], prog: str | None = None) -> dict[str, str]:
    """The values given on the command line, by field name, as strings (unconverted: the
    config's ``from_dict`` checks them). ``--help`` prints the help and exits with code 0.

    Raises:
        MistillInputError: an unknown option, a value that belongs to no option, or an option
            without its value.
    """
    parser = stage_parser(stage, prog)
    names = {f"--{f.name}" for f in dataclasses.fields(stage.config)}
    try:
        given, extra = parser.parse_known_args(_dashes_to_underscores(argv, names))
    except _UsageError as exc:
        message = str(exc)
        option = re.search(r"argument --(\w+)", message)
        if option and "expected one argument" in message:
            message = f"--{option.group(1)} needs a value"
        raise MistillInputError(message, field=option.group(1) if option else "argv") from None
    if extra:
        raise _unknown_error(stage, extra)
    return dict(vars(given))


# ---------------------------------------------------------------------------------- launching
LAUNCHERS = ("none", "torchrun", "accelerate")


def split_launch_args(stage: Stage, argv: Sequence[str]) -> tuple[str, int, list[str]]:
    """``(launcher, nproc, the other arguments)`` of a shardable stage's command line
    (``--launcher``/``--nproc``, also as ``--name=value``); a stage that is not shardable keeps
    them among the others (the parser then refuses them as unknown).

    Raises:
        MistillInputError: an unknown launcher, or a process count that is not a positive integer.
    """
    values = {"launcher": "none", "nproc": "1"}
    rest: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        key, eq, value = args[i].partition("=")
        name = key[2:] if key.startswith("--") else ""
        if stage.shardable and name in values:
            if not eq:
                if i + 1 >= len(args):
                    raise MistillInputError(f"--{name} needs a value", field=name)
                value, i = args[i + 1], i + 1
            values[name] = value
        else:
            rest.append(args[i])
        i += 1
    launcher = values["launcher"] or "none"
    if launcher not in LAUNCHERS:
        raise MistillInputError(f"unknown launcher {launcher!r}; accepted: {', '.join(LAUNCHERS)}",
                                field="launcher")
    try:
        nproc = int(float(values["nproc"]))
    except ValueError:
        nproc = 0
    if nproc < 1 or str(values["nproc"]).strip() not in (str(nproc), f"{nproc}.0"):
        raise MistillInputError(f"nproc must be a positive integer, got {values['nproc']!r}", field="nproc")
    return launcher, nproc, rest


def launch_command(stage_name: str, nproc: int, argv: Sequence[str], launcher: str = "torchrun") -> list[str]:
    """The command that starts ``nproc`` processes of the stage on this node, each with ``argv``.

    ``torchrun``: ``torch.distributed.run --standalone`` (a local rendezvous on a free port);
    ``accelerate``: ``accelerate launch --multi_gpu`` (its process launcher, which also starts CPU
    processes) on a free port. Both describe each process in ``RANK`` / ``WORLD_SIZE`` /
    ``LOCAL_RANK`` (:func:`mistill.distributed.current_world`).
    """
    script = sys.argv[0]
    target = [script] if script.endswith(".py") else ["--module", "mistill.stages.cli", stage_name]
    if launcher == "accelerate":
        return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", f"--num_processes={nproc}",
                "--num_machines=1", "--mixed_precision=no", "--dynamo_backend=no",
                f"--main_process_port={_free_port()}", *target, *argv]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            *target, *argv]


def _free_port() -> int:
    import socket  # deferred: only a launch needs it, `mistill --help` does not

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch(stage_name: str, nproc: int, argv: Sequence[str], launcher: str = "torchrun") -> int:
    """Run the stage as ``nproc`` processes under ``launcher`` and return its exit status (rank
    0's run id line is printed by rank 0)."""
    import subprocess  # deferred: only a launch needs it, `mistill --help` does not

    cmd = launch_command(stage_name, nproc, argv, launcher)
    shown = "torchrun --standalone" if launcher == "torchrun" else "accelerate launch --multi_gpu"
    print(f"mistill {stage_name}: starting {nproc} processes: {shown} ...", file=sys.stderr)
    return subprocess.run(cmd, check=False).returncode


# ------------------------------------------------------------------------------------ running
def check_tracking_server() -> str:
    """The tracking URI every client of this process uses, after one request to it.

    ``MLFLOW_TRACKING_URI``, else the project's server under the mistill root, started if needed
    (as a stage's own run would): the input runs are then read from the server the stage writes
    to, never from a local store. An unreachable server raises the MLflow error that
    :func:`~mistill.tracking.connection.tracking_errors` reports (exit code 3).
    """
    from mlflow.tracking import MlflowClient  # deferred: MLflow is not needed for `--help`

    from mistill.tracking.experiments import resolve_tracking_uri  # deferred: imports MLflow

    uri = resolve_tracking_uri(mistill_root())
    os.environ["MLFLOW_TRACKING_URI"] = uri
    MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
    return uri


def main(stage_name: str, argv: Sequence[str] | None = None, *, prog: str | None = None) -> str:
    """Run one entry point; prints and returns the run id.

    Exits with code 2 on bad input, 3 when the tracking server cannot be reached (the run is
    left as it was: rerunning the same command resumes it), 4 when an identical run is held by
    another live process and waiting was refused; the message goes to stderr, as one line.
    ``--help`` prints the stage's options and exits with code 0. Bad options, values and missing
    required input runs are refused before the tracking server is contacted; the server is then
    asked once (:func:`check_tracking_server`), and the input runs, models and files the config
    names are checked (:func:`~mistill.stages.runner.preflight`), before the stage starts.

    Under ``mlflow run`` (``MLFLOW_RUN_ID`` set), the run ``mlflow run`` opened holds every ``-P``
    value as a param before the stage starts. A refusal (exit code 2 or 4) of a stage that did not
    adopt that run purges it from the tracking store, params, tags, metrics and artifacts, so no
    refused value stays there (:func:`purge_launched_run`). Where the command line reads a
    restricted corpus, the corpus's privacy guard first checks every value given and every param
    of that run (:func:`refusal_guard`): a value holding protected note text is named by its
    field, and the stage's message, which could repeat it, is not shown.
    """
    from mistill.stages.runner import preflight  # deferred: imports MLflow and torch, not needed for `--help`
    from mistill.tracking.connection import configure_client_timeouts, tracking_errors  # deferred: numpy
    from mistill.parent_watch import die_with_launcher  # deferred: imports ctypes, not needed for `--help`
    from mistill.tracking.lease import LeaseError  # deferred: imports MLflow, not needed for `mistill --help`

    stage = find_stage(stage_name)
    die_with_launcher()  # a step launched by a workflow ends with it (mistill.parent_watch)
    if current_world().rank > 0:  # the run `mlflow run` opened is rank 0's to adopt or discard
        os.environ.pop("MLFLOW_RUN_ID", None)
    given: dict[str, str] = {}
    try:
        launcher, nproc, rest = split_launch_args(stage, sys.argv[1:] if argv is None else argv)
        given = parse_stage_args(stage, rest, prog)
        configure_client_timeouts()
        with tracking_errors():
            cfg = stage.config.from_dict(given, source=f"entry point {stage_name}")
            stage.check_inputs(cfg)
            cfg.check_environment()
            check_tracking_server()
            preflight(stage, cfg)
            if launcher != "none" and "WORLD_SIZE" not in os.environ:
                status = launch(stage_name, nproc, rest, launcher)
                if status:
                    raise SystemExit(status)
                return ""
            run_id = stage.run(cfg)
            leave_world()  # every rank's work is done: the group goes while the interpreter is whole
    except MistillInputError as exc:
        refuse(stage, exc, given)
        raise SystemExit(EXIT_INPUT) from None
    except LeaseError as exc:
        refuse(stage, exc, given)
        raise SystemExit(EXIT_BUSY) from None
    except TrackingUnavailableError as exc:
        print(f"mistill {stage_name}: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_UNREACHABLE) from None
    if current_world().leader and run_id:  # a dry run creates none
        print(f"mistill {stage_name}: run {run_id}")
    return run_id


def refuse(stage: Stage, exc: Exception, given: Mapping[str, str]) -> None:
    """Say on stderr, in one line, why the stage refused (``exc``) and what became of the run
    ``mlflow run`` opened for it (purged: :func:`purge_launched_run`).

    When there is such a run and the corpus the command line reads is restricted
    (:func:`refusal_guard`), every value given, every param, tag and the name of that run, and
    the refusal's message are checked first: when one holds protected note text, the line names
    where, never the text, and leaves the message out. A
    :class:`~mistill.tracking.privacy.PrivacyError` is shown as it is: it names only where the
    text was. Without such a run (a direct launch) nothing reached the tracking store, and the
    refusal asks the tracking server nothing: the message is shown as the stage wrote it.
    """
    from mistill.tracking.privacy import PrivacyError  # deferred: imports numpy, not needed for `mistill --help`

    message = str(exc)
    launched = os.environ.get("MLFLOW_RUN_ID") or None
    if launched is None:
        print(f"mistill {stage.name}: {message}", file=sys.stderr)
        return
    held = None
    if not isinstance(exc, PrivacyError):
        with contextlib.suppress(Exception):  # the refusal is said whatever the guard's inputs hold
            held = protected_value(stage, given, launched, message)
    if held is not None:
        message = (f"{held} holds protected note text (corpus privacy level 'restricted'): refused; the "
                   "stage's message is not shown, as it may repeat it")
    fate = purge_launched_run(launched)
    print(f"mistill {stage.name}: {message}{'; ' + fate if fate else ''}", file=sys.stderr)


def protected_value(stage: Stage, given: Mapping[str, str], launched: str, message: str) -> str | None:
    """Where the refused command line, or the run ``launched`` that ``mlflow run`` opened for it,
    holds text the privacy guard of its restricted corpus protects (``param split``, ``run name``,
    ``the refusal's message``), or None (no such text, or a corpus that is not restricted or
    cannot be read here)."""
    from mlflow.tracking import MlflowClient  # deferred: mlflow.tracking is slow to import

    from mistill.tracking.privacy import PrivacyError  # deferred: imports numpy
    from mistill.tracking.purge import protected_place  # deferred: imports MLflow

    guard = refusal_guard(stage, given)
    if guard is None:
        return None
    try:
        guard.check_mapping(dict(given), "param")
    except PrivacyError as exc:
        return exc.where
    with contextlib.suppress(Exception):  # a run already purged holds nothing
        where = protected_place(MlflowClient().get_run(launched), guard)
        if where is not None:
            return where
    return "the refusal's message" if guard.contains_protected(message) else None


LINEAGE_MAX_RUNS = 64
"""The most runs :func:`refusal_guard` reads to find the corpus behind a command line's inputs."""


def refusal_guard(stage: Stage, given: Mapping[str, str]) -> PrivacyGuard | None:
    """The privacy guard of the restricted corpus a command line reads through its input runs
    (``prepare_run``, ``events_run``, ...: followed along their ``mistill.input.*`` lineage to the
    run that holds the prepared data), or None: no input run, input runs of a corpus that is not
    restricted, or a corpus that cannot be read on this machine (an unknown run id, a data folder
    that is not here)."""
    from mlflow.tracking import MlflowClient  # deferred: mlflow.tracking is slow to import

    from mistill.stages.common import TAG_DATA_DIR, load_prepared, privacy_guard  # deferred: imports MLflow, torch
    from mistill.tracking.naming import TAG_INPUT_PREFIX, TAG_PRIVACY  # deferred: the tracking package loads numpy

    client = MlflowClient()
    todo = [str(given.get(f, "")) for f in stage.inputs.values()]
    seen: set[str] = set()
    while todo and len(seen) < LINEAGE_MAX_RUNS:
        run_id = todo.pop(0)
        if run_id in seen or RUN_ID.fullmatch(run_id) is None:
            continue
        seen.add(run_id)
        try:
            tags = client.get_run(run_id).data.tags
        except Exception:  # noqa: BLE001 - an unknown run is the stage's refusal, not this one's
            continue
        if tags.get(TAG_PRIVACY) != "restricted":
            continue
        if TAG_DATA_DIR in tags:
            try:
                return privacy_guard(load_prepared(run_id).corpus)
            except (MistillInputError, OSError):
                return None
        todo += [value for key, value in sorted(tags.items()) if key.startswith(TAG_INPUT_PREFIX)]
    return None


def overview() -> str:
    """``mistill --help``: usage, every stage with its one-line help, the exit codes."""
    table = stage_help()
    width = max(len(name) for name in table) + 2
    rows = "\n".join(textwrap.fill(text, 96, initial_indent=f"  {name:<{width}}",
                                    subsequent_indent=" " * (width + 2)) for name, text in table.items())
    return (f"usage: mistill <stage> [--name value ...]\n       mistill <stage> --help\n\n"
            f"Run one stage of the platform (each is also an MLflow entry point: "
            f"`mlflow run . -e <stage>`).\n\nstages:\n{rows}\n\n{textwrap.fill(EXIT_STATUS, 96)}\n")


def console(argv: Sequence[str] | None = None) -> int:
    """The ``mistill`` command: ``mistill <stage> [--name value ...]``; returns the exit status.

    ``mistill --help`` lists the stages, ``mistill <stage> --help`` a stage's options.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(overview(), file=sys.stdout if args else sys.stderr, end="")
        return 0 if args else EXIT_INPUT
    name, rest = args[0], args[1:]
    if name not in stage_help():
        closest = difflib.get_close_matches(name, list(stage_help()), n=1, cutoff=CLOSE_MATCH)
        hint = f"; the closest is {closest[0]!r}" if closest else ""
        print(f"mistill: unknown stage {name!r}{hint} (`mistill --help` lists the stages)", file=sys.stderr)
        return EXIT_INPUT
    try:
        main(name, rest, prog=f"mistill {name}")
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


def discard_launched_run() -> None:
    """Have the run ``mlflow run`` opened for this process (``MLFLOW_RUN_ID``) deleted once
    ``mlflow run`` has ended it, when no stage adopted it (it carries no ``mistill.stage`` tag):
    an entry point with nothing to run (a dry run) leaves no empty run
    (:mod:`mistill.tracking.reaper`). A refusal purges that run instead
    (:func:`purge_launched_run`)."""
    from mlflow.exceptions import MlflowException  # deferred: mlflow.exceptions is slow to import
    from mlflow.tracking import MlflowClient  # deferred: mlflow.tracking is slow to import

    from mistill.tracking.reaper import spawn_reaper  # deferred: imports MLflow
    from mistill.tracking.naming import TAG_STAGE  # deferred: the tracking package loads numpy

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


def purge_launched_run(launched: str) -> str:
    """Purge the run ``mlflow run`` opened for this process (``launched``, its ``MLFLOW_RUN_ID``)
    unless a stage adopted it (it carries a ``mistill.stage`` tag), or the stage's refusal already
    purged it or left it to a purger; returns what was done, for the refusal's line ('' when
    nothing was).

    Such a run holds only what ``mlflow run`` stored: the ``-P`` values the refused command line
    came from, so deleting it is not enough
    (:func:`mistill.tracking.purge.purge_launched_run`). When it cannot be purged the text gives
    the ``mlflow gc`` command an operator must run.
    """
    from mlflow.exceptions import MlflowException  # deferred: mlflow.exceptions is slow to import
    from mlflow.tracking import MlflowClient  # deferred: mlflow.tracking is slow to import

    from mistill.tracking import purge  # deferred: imports MLflow
    from mistill.tracking.naming import TAG_STAGE  # deferred: the tracking package loads numpy

    client = MlflowClient()
    if purge.purge_pending(launched):  # the stage's own refusal said so
        return ""
    try:
        run = client.get_run(launched)
        if TAG_STAGE in run.data.tags or run.info.lifecycle_stage == "deleted":
            return ""
        outcome = purge.purge_launched_run(launched, tracking_uri=client.tracking_uri, root=mistill_root())
    except purge.RunNotPurgedError as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - the refusal is said, with what is left to do
        if isinstance(exc, MlflowException) and exc.error_code == "RESOURCE_DOES_NOT_EXIST":
            return ""
        return (f"run {launched} that `mlflow run` opened holds the refused values and could not be purged "
                f"({type(exc).__name__}); delete it, then run: "
                f"{shlex.join(purge.gc_command(launched, client.tracking_uri))}")
    if outcome == purge.ABSENT:
        return ""
    return f"run {launched} that `mlflow run` opened held these values: {purge.purged_words(outcome)}"


if __name__ == "__main__":
    raise SystemExit(console())
