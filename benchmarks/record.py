"""Fold a benchmark's raw JSON output into benchmarks/results.json ({name: {value, unit, card, date, command}}).

Usage: python benchmarks/record.py RAW.json --prefix instrument.qwen3-14b --date 2026-11-29 \
           --command "python3 benchmarks/bench_instrument.py ..."
Units are inferred from the key (``_s`` seconds, ``_gib`` GiB, ``per_s`` per second, ``nats``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def unit_of(key: str) -> str:
    if "per_s" in key:
        return "patches/s" if "patch" in key else "1/s"
    if key.endswith("_gib"):
        return "GiB"
    if key.endswith("_s"):
        return "s"
    if key.endswith("_ms"):
        return "ms"
    if "nats" in key or "margin" in key:
        return "nats"
    return "count"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("raw")
    ap.add_argument("--prefix", required=True, help="prepended to every key (empty: the keys as written)")
    ap.add_argument("--date", required=True)
    ap.add_argument("--command", required=True)
    args = ap.parse_args()
    raw = json.loads(Path(args.raw).read_text())
    path = HERE / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    card = raw.get("card", "unknown")
    for key, value in raw.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        results[f"{args.prefix}.{key}" if args.prefix else key] = {"value": value, "unit": unit_of(key), "card": card,
                                           "date": args.date, "command": args.command}
    path.write_text(json.dumps(dict(sorted(results.items())), indent=2) + "\n")
    print(f"{len(results)} results in {path}")


if __name__ == "__main__":
    main()
