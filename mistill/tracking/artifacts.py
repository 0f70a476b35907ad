"""What a stage run logs: params, tags, metrics, files, tables, figures and datasets.

* Everything bound for the tracking store passes the corpus's
  :class:`~mistill.tracking.privacy.PrivacyGuard`.
* Params are written typed (:func:`~mistill.tracking.identity.param_string`); metric names are
  checked (:func:`~mistill.tracking.naming.check_metric_name`); tables go out as CSV and Markdown
  (:func:`markdown_table`), and as MLflow tables on request; figures as self-contained HTML
  (:func:`~mistill.tracking.figure_html.figure_html`).
"""

from __future__ import annotations

import json
import math
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlflow
from mlflow.entities import DatasetInput, InputTag, Metric, Param, RunTag

from mistill.io import write_json, write_text
from mistill.tracking.figure_html import figure_html
from mistill.tracking.identity import param_string
from mistill.tracking.naming import _check_component, check_metric_name

DATASET_DIGEST_CHARS = 36
MAX_TAG_VALUE = 8000  # MLflow's limit on a tag value
_PARAMS_PER_BATCH = 100
_METRICS_PER_BATCH = 1000


class ArtifactLogging:
    """The logging side of :class:`~mistill.tracking.runs.StageRun` (mixed into it: uses its
    ``client``, ``guard``, ``run``, ``run_id``, ``work_dir`` and ``_require_active``)."""

    # ------------------------------------------------------------------------------ logging
    def _log_batch(self, *, params: Mapping[str, Any] | None = None,
                   tags: Mapping[str, str] | None = None,
                   metrics: list[Metric] | None = None) -> None:
        run_id = mlflow.active_run().info.run_id if self.run is None else self.run_id
        p = [Param(k, param_string(v)) for k, v in (params or {}).items()]
        t = [RunTag(k, v if len(v) <= MAX_TAG_VALUE else v[:MAX_TAG_VALUE])
             for k, v in (tags or {}).items()]
        for i in range(0, len(p), _PARAMS_PER_BATCH):
            self.client.log_batch(run_id, params=p[i:i + _PARAMS_PER_BATCH])
        for i in range(0, len(t), _PARAMS_PER_BATCH):
            self.client.log_batch(run_id, tags=t[i:i + _PARAMS_PER_BATCH])
        m = metrics or []
        for i in range(0, len(m), _METRICS_PER_BATCH):
            self.client.log_batch(run_id, metrics=m[i:i + _METRICS_PER_BATCH])

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Log numeric metrics (names checked by the privacy guard).

        Raises:
            MistillInputError: a name holds ``.`` (see :func:`check_metric_name`); nothing of
                the batch is logged.
        """
        self._require_active()
        self.guard.check_mapping({k: None for k in metrics}, "metric")
        for k in metrics:
            check_metric_name(k)
        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, int(step or 0)) for k, v in metrics.items()]
        self._log_batch(metrics=batch)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Set tags (keys and values checked by the privacy guard)."""
        self._require_active()
        str_tags = {k: str(v) for k, v in tags.items() if v is not None}
        self.guard.check_mapping(str_tags, "tag")
        self._log_batch(tags=str_tags)

    def log_artifact_file(self, local_path: Path | str, artifact_path: str | None = None) -> None:
        """Log a file (or a directory's contents) after the privacy guard has checked it."""
        self._require_active()
        p = Path(local_path)
        if p.is_dir():
            self.guard.check_dir(p)
            self.client.log_artifacts(self.run_id, str(p), artifact_path)
        else:
            self.guard.check_file(p)
            self.client.log_artifact(self.run_id, str(p), artifact_path)

    def _local_artifact(self, name: str) -> tuple[Path, str | None]:
        """Local path under ``<work>/artifacts/`` for artifact ``name`` (may contain '/')."""
        parts = [_check_component(part, "artifact name") for part in name.split("/")]
        path = self.work_dir.joinpath("artifacts", *parts)
        return path, "/".join(parts[:-1]) or None

    def log_json(self, name: str, obj: Any) -> Path:
        """Write ``obj`` as JSON to ``<name>`` (``.json`` appended if missing) and log it."""
        if not name.endswith(".json"):
            name += ".json"
        path, artifact_dir = self._local_artifact(name)
        write_json(path, obj)
        self.log_artifact_file(path, artifact_dir)
        return path

    def log_table(self, name: str, df: Any, *, float_format: str = ".6g",
                  index: bool | None = None, mlflow_table: bool = False) -> tuple[Path, Path]:
        """Log a pandas DataFrame as ``<name>.csv`` and ``<name>.md``; return both local paths.

        ``index`` defaults to writing the index only when it is not a plain RangeIndex.
        ``mlflow_table``: also log it as an MLflow table, ``<name>.json``
        (:meth:`log_mlflow_table`).
        """
        import pandas as pd  # deferred: pandas is slow to import

        if index is None:
            index = not isinstance(df.index, pd.RangeIndex) or df.index.name is not None
        csv_path, artifact_dir = self._local_artifact(name + ".csv")
        md_path = csv_path.with_suffix(".md")
        write_text(csv_path, df.to_csv(index=index))
        write_text(md_path, markdown_table(df, float_format=float_format, index=index))
        self.guard.check_file(csv_path)
        self.guard.check_file(md_path)
        self.log_artifact_file(csv_path, artifact_dir)
        self.log_artifact_file(md_path, artifact_dir)
        if mlflow_table:
            self.log_mlflow_table(name, df.reset_index() if index else df)
        return csv_path, md_path

    def log_mlflow_table(self, name: str, df: Any) -> Path:
        """Log a pandas DataFrame as the MLflow table ``<name>.json`` and return its local path.

        The file is what ``mlflow.log_table`` writes (``orient="split"``, no index), so
        ``mlflow.load_table`` reads it back, and it is listed in the run's
        ``mlflow.loggedArtifacts`` tag, so the UI shows it as a table. Unlike ``mlflow.log_table``
        a second call replaces the table instead of appending to it: a resumed run logs it once.
        For a restricted corpus the frame must hold no free text and no protected text
        (:meth:`~mistill.tracking.privacy.PrivacyGuard.check_dataframe`), then the file is checked like any artifact.
        """
        # deferred: mlflow.utils.mlflow_tags is slow to import
        from mlflow.utils.mlflow_tags import MLFLOW_LOGGED_ARTIFACTS

        self._require_active()
        self.guard.check_dataframe(df, f"table {name}")
        path, artifact_dir = self._local_artifact(name + ".json")
        write_text(path, df.to_json(orient="split", index=False, date_format="iso"))
        self.log_artifact_file(path, artifact_dir)
        entry = {"path": f"{artifact_dir}/{path.name}" if artifact_dir else path.name, "type": "table"}
        listed = json.loads(self.client.get_run(self.run_id).data.tags.get(MLFLOW_LOGGED_ARTIFACTS) or "[]")
        if entry not in listed:
            self._log_batch(tags={MLFLOW_LOGGED_ARTIFACTS: json.dumps(listed + [entry])})
        return path

    def log_figure(self, fig: Any, name: str) -> Path:
        """Log a plotly figure as self-contained HTML (plotly.js embedded, gzip-compressed: it
        draws offline, in MLflow's artifact viewer and from disk; :mod:`mistill.tracking.figure_html`).

        The figure's JSON (all its data and text) is what the privacy guard checks.
        """
        self._require_active()
        if not name.endswith(".html"):
            name += ".html"
        if not self.guard.allows_text:
            self.guard.check_text(fig.to_json(), f"figure {name}")
        path, artifact_dir = self._local_artifact(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        html = figure_html(fig, title=Path(name).stem)
        write_text(path, html)
        self.client.log_artifact(self.run_id, str(path), artifact_dir)
        return path

    def log_dataset(self, df: Any, name: str, digest: str, context: str) -> None:
        """Record a dataset as a run input (``mlflow.log_input``): schema, size and digest.

        Restricted corpora: refused if a column name or a string cell carries protected text,
        or a string column holds free text (see :meth:`~mistill.tracking.privacy.PrivacyGuard.check_dataframe`).
        """
        self._require_active()
        import mlflow.data  # deferred: mlflow.data is slow to import

        self.guard.check_text(name, "dataset name")
        self.guard.check_dataframe(df, f"dataset {name}")
        # MLflow keeps at most 36 characters of a dataset digest: log its head, tag the whole
        self.set_tags({f"mistill.dataset_digest.{name}": digest})
        with warnings.catch_warnings():  # schema inference hints about integer columns
            warnings.filterwarnings("ignore", category=UserWarning, module=r"mlflow\.")
            dataset = mlflow.data.from_pandas(df, name=name, digest=digest[:DATASET_DIGEST_CHARS])
            active = mlflow.active_run()
            if active is not None and active.info.run_id == self.run_id:
                mlflow.log_input(dataset, context=context)
            else:
                # deferred: mlflow.utils.mlflow_tags is slow to import
                from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

                self.client.log_inputs(self.run_id, [DatasetInput(
                    dataset._to_mlflow_entity(), [InputTag(MLFLOW_DATASET_CONTEXT, context)])])


def markdown_table(df: Any, *, float_format: str = ".6g", index: bool = False) -> str:
    """A GitHub-flavoured Markdown table of a DataFrame (no ``tabulate`` needed).

    Numbers are right-aligned; floats use ``float_format``; ``|`` and newlines are escaped.
    """
    import pandas as pd  # deferred: pandas is slow to import

    def cell(v: Any) -> str:
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return ""
        if isinstance(v, float):
            return format(v, float_format)
        return str(v).replace("|", "\\|").replace("\r", " ").replace("\n", "<br>")

    frame = df.reset_index() if index else df
    headers = [cell(c) for c in frame.columns]
    numeric = [pd.api.types.is_numeric_dtype(frame[c]) and not pd.api.types.is_bool_dtype(frame[c])
               for c in frame.columns]
    rows = [[cell(v.item() if hasattr(v, "item") else v) for v in rec]
            for rec in frame.itertuples(index=False, name=None)]
    widths = [max([len(h), 3] + [len(r[j]) for r in rows]) for j, h in enumerate(headers)]

    def line(values: list[str]) -> str:
        return "| " + " | ".join(v.rjust(w) if num else v.ljust(w)
                                 for v, w, num in zip(values, widths, numeric)) + " |"

    sep = "| " + " | ".join(("-" * (w - 1) + ":") if num else "-" * w
                            for w, num in zip(widths, numeric)) + " |"
    return "\n".join([line(headers), sep] + [line(r) for r in rows]) + "\n"


__all__ = ["DATASET_DIGEST_CHARS", "MAX_TAG_VALUE", "ArtifactLogging", "markdown_table"]
