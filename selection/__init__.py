"""Pre-registered λ selection (App. I.3, I.4, M.2), run by the ``select_lambda`` entry point.

* ``lock``: the YAML lock that fixes the grid, arm, training size, metric, band, tie-break and
  edge rule before any trial; its sha256 guards the study.
* ``cells``: grid cells, the runner contract ``(CellRun) -> CellResult``, the outward cell.
* ``grid``: the Optuna study (RDB storage, GridSampler), each cell run to completion once across
  threads and processes (spawned worker processes for runners that load models); a worker waits
  for cells another one runs; cells whose runner failed reported with their reason and retried by
  a rerun up to the study's ``max_retries``; cells whose worker died retried.
* ``heartbeat``: liveness of a running cell (Optuna's heartbeat), stale trials failed and queued
  again through Optuna's retry callback.
* ``decide``: the decision rule (pure) and the sensitivity view over other bands.
* ``report``: ``decision.json``, the cell table and the sensitivity table.
* ``runner``: the default runner, ``train`` then ``evaluate`` through the entry points.
"""
