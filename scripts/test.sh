#!/usr/bin/env bash
# Set everything up and run the test suite (a real MLflow server on a free port, tiny models and
# the real SmolLM2-135M). Extra arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh || exit 1
# headless Chromium for the browser tests (tests/test_browser.py), from Debian's packages;
# skipped when it is already there. Without it those tests fail, they do not skip.
if ! command -v chromium >/dev/null 2>&1; then
  echo "installing chromium for the browser tests" >&2
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } \
    >/dev/null 2>&1 || echo "could not install chromium: the browser tests will fail" >&2
fi
# shellcheck disable=SC1091
. .venv/bin/activate
export MLFLOW_DISABLE_TELEMETRY=true HF_HUB_OFFLINE=1
python -m pytest -q "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
