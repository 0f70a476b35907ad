"""Command line of the entry point scripts: ``--name value`` pairs into the stage's config."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from mistill.errors import MistillInputError


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
    """Run one entry point; prints and returns the run id."""
    from mistill.stages.registry import stages

    stage = stages()[stage_name]
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.pop("help", None) is not None:
        print(f"{stage.name}: {stage.help}\nparameters: {stage.config().to_dict()}")
        return ""
    try:
        cfg = stage.config.from_dict(args, source=f"entry point {stage_name}")
        run_id = stage.run(cfg)
    except MistillInputError as exc:
        print(f"mistill {stage_name}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"mistill {stage_name}: run {run_id}")
    return run_id
