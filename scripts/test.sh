#!/usr/bin/env bash
# Set everything up and run the test suite (a real MLflow server on a free port, tiny models and
# the real SmolLM2-135M). Extra arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh || exit 1
# From Debian's packages, each skipped when it is already there (without them their tests fail,
# they do not skip): headless Chromium for the browser tests (tests/test_browser.py), and
# PostgreSQL's server for the PostgreSQL store tests (tests/test_postgres.py; the tests start
# their own server on a free port, never the package's cluster).
missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
if ! command -v initdb >/dev/null 2>&1 && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  missing+=(postgresql)
fi
if [ "${#missing[@]}" -gt 0 ]; then
  echo "installing ${missing[*]} for the tests" >&2
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"; } \
    >/dev/null 2>&1 || echo "could not install ${missing[*]}: their tests will fail" >&2
fi
# shellcheck disable=SC1091
. .venv/bin/activate
export MLFLOW_DISABLE_TELEMETRY=true HF_HUB_OFFLINE=1
# two worker processes (pytest-xdist), each test file whole on one of them, so that a file's
# module-scoped fixtures are built once, in the collection order (tests/conftest.py puts the
# longest files first; xdist's own reordering by test count would start them last);
# MISTILL_TEST_WORKERS=0 runs everything in one process
# each worker's torch (and the processes it starts) on its share of the cores: two workers of
# two threads each on two cores spend about half their CPU time waiting on one another
workers="${MISTILL_TEST_WORKERS:-2}"
if [ "$workers" -gt 0 ] && [ -z "${OMP_NUM_THREADS:-}" ]; then
  share=$(( $(nproc) / workers ))
  export OMP_NUM_THREADS=$(( share > 0 ? share : 1 ))
fi
python -m pytest -q -n "$workers" --dist loadfile --no-loadscope-reorder "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
