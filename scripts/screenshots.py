"""Take the pictures of the MLflow UI that docs/ shows, from a finished demo, in headless Chromium.

    ./scripts/demo.sh                                   # a finished demo and its running server
    eval "$(.venv/bin/python -m mistill.tracking.server env)"
    .venv/bin/python scripts/screenshots.py             # writes docs/screenshots/*.png

Three pictures: the experiment's runs table (``runs_table.png``, the link the demo prints), the
compare view of the ``evaluate`` runs that read an arm (``compare_arms.png``: their params line
the arms up), and one Mistill ``evaluate`` run's page (``evaluate_run.png``). The server and its
credentials come from ``MLFLOW_TRACKING_URI`` / ``MLFLOW_TRACKING_USERNAME`` /
``MLFLOW_TRACKING_PASSWORD``, as for every client of the project. Each page is awaited until the
text it must show is there; a page that never shows it is an error, never a blank picture.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

from mlflow.tracking import MlflowClient

from mistill.tracking.browser import Chromium
from mistill.tracking.experiments import experiment_url

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experiment", default="mistill/synthetic")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "screenshots")
    ap.add_argument("--width", type=int, default=1600)
    ap.add_argument("--height", type=int, default=1000)
    args = ap.parse_args()
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if not uri.startswith("http"):
        print("screenshots: set MLFLOW_TRACKING_URI to the demo's server "
              "(eval \"$(.venv/bin/python -m mistill.tracking.server env)\")", file=sys.stderr)
        return 2
    user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
    auth = (user, password) if user and password else None
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(args.experiment)
    if exp is None:
        print(f"screenshots: no experiment {args.experiment!r} on {uri}: run ./scripts/demo.sh first", file=sys.stderr)
        return 2
    runs = client.search_runs([exp.experiment_id], "attributes.status = 'FINISHED'", max_results=1000)
    def arm_of(r) -> str:  # every readout shows its arm in `arm` (a train run's reader also in `arm.name`)
        return r.data.params.get("arm") or r.data.params.get("arm.name") or ""

    # the latest pipeline's runs only: a store that has seen several demos compares one of them
    pipelines = [r for r in runs if r.data.tags.get("mistill.stage") == "pipeline"]
    since = max((r.info.start_time for r in pipelines), default=0)
    evaluates = [r for r in runs if r.data.tags.get("mistill.stage") == "evaluate" and arm_of(r)
                 and r.info.start_time >= since]
    if not evaluates:
        print(f"screenshots: experiment {args.experiment!r} has no finished evaluate run of an arm", file=sys.stderr)
        return 2
    evaluates.sort(key=lambda r: (arm_of(r), r.data.params.get("seed", ""), r.info.run_name))
    mistill = next((r for r in evaluates if arm_of(r) == "mistill"), evaluates[0])
    ids = json.dumps([r.info.run_id for r in evaluates])
    compare = (f"{uri}/#/compare-runs?runs={urllib.parse.quote(ids)}"
               f"&experiments={urllib.parse.quote(json.dumps([exp.experiment_id]))}")
    # the runs table lists top-level runs, each pipeline's steps nested (collapsed) under it
    top = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    listed = next((r for r in top if r.data.tags.get("mistill.stage") == "pipeline"), top[0] if top else evaluates[0])
    shots = [
        ("runs_table.png", experiment_url(uri, exp.experiment_id), (listed.info.run_name,)),
        ("compare_arms.png", compare, ("arm", mistill.info.run_name)),
        ("evaluate_run.png", f"{uri}/#/experiments/{exp.experiment_id}/runs/{mistill.info.run_id}",
         (mistill.info.run_name, "Parameters")),
    ]
    with tempfile.TemporaryDirectory(prefix="mistill-shots-") as profile:
        browser = Chromium(Path(profile))
        try:
            for name, url, needles in shots:
                page = browser.page(args.width, args.height, auth=auth)
                page.navigate(url)
                page.wait_for_text(*needles, timeout=90)
                time.sleep(1.5)  # let the last requests settle
                page.screenshot(args.out / name)
                print(f"wrote {args.out / name} ({url})")
        finally:
            browser.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
