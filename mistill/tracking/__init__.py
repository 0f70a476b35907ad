"""MLflow tracking layer: the server's life, run conventions, and the privacy guard.

``server``, ``connection`` and ``privacy`` do not import MLflow; the names of the run modules
(``runs``, ``identity``, ``experiments``, ...: most import MLflow) are loaded on first use, so
``python -m mistill.tracking.server`` stays quick.

Importing this package bounds every MLflow request to the tracking server by
``MISTILL_SERVER_TIMEOUT_S`` (default 60 s; see :mod:`mistill.tracking.connection`).
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from mistill.errors import MistillInputError
from mistill.tracking.connection import configure_client_timeouts
from mistill.tracking.privacy import PRIVACY_LEVELS, PrivacyError, PrivacyGuard

try:
    configure_client_timeouts()
except MistillInputError as _exc:  # the stage command line reports it (exit code 2)
    warnings.warn(f"{_exc}; MLflow's own HTTP retry defaults apply", stacklevel=2)

# server names load lazily too: `python -m mistill.tracking.server` must not find the module
# already imported by its package
_SERVER_NAMES = {"TrackingServer", "ensure_server"}

_RUN_NAMES = {
    "StageRun": "runs",
    "find_run": "identity", "code_version": "identity", "git_commit": "identity",
    "params_digest": "identity", "canonical_params": "identity", "RESUMABLE_STATUSES": "identity",
    "experiment_for_corpus": "experiments", "resolve_tracking_uri": "experiments",
    "markdown_table": "artifacts",
    **dict.fromkeys((
        "run_name", "TAG_STAGE", "TAG_MODEL", "TAG_CORPUS", "TAG_CORPUS_DIGEST", "TAG_PRIVACY", "TAG_ARM",
        "TAG_SEED", "TAG_PRECISION", "TAG_GIT_COMMIT", "TAG_CODE_VERSION", "TAG_ENTRY_POINT",
        "TAG_PARAMS_DIGEST", "TAG_INPUT_PREFIX"), "naming"),
}
"""Each lazily loaded name and the module of ``mistill.tracking`` that defines it."""

__all__ = ["PRIVACY_LEVELS", "PrivacyError", "PrivacyGuard", "TrackingServer", "ensure_server",
           *sorted(_RUN_NAMES)]


def __getattr__(name: str) -> Any:
    if name in _SERVER_NAMES:
        return getattr(importlib.import_module("mistill.tracking.server"), name)
    if name in _RUN_NAMES:
        return getattr(importlib.import_module(f"mistill.tracking.{_RUN_NAMES[name]}"), name)
    raise AttributeError(f"module 'mistill.tracking' has no attribute {name!r}")
