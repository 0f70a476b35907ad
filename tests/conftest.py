"""Shared fixtures. ``tracking_uri``: one real MLflow server (SQLite) for the whole session."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from mistill.tracking.server import TrackingServer


@pytest.fixture(scope="session")
def tracking_uri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Start ``mlflow server`` through :class:`TrackingServer` on a free port; set
    ``MLFLOW_TRACKING_URI`` for the session; stop the server at the end."""
    server = TrackingServer(root=tmp_path_factory.mktemp("mlflow-server"), port=0)
    saved = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "MLFLOW_DISABLE_TELEMETRY")}
    uri = server.start()
    os.environ["MLFLOW_TRACKING_URI"] = uri
    os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
    try:
        yield uri
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
