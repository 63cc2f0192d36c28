#!/usr/bin/env bash
# The test suite: real processes (gloo ranks, daemon, CLI), real files. Run scripts/setup.sh first.
#   bash scripts/test.sh            the full suite (what CI runs)
#   bash scripts/test.sh --quick    the quick tier: the in-process tests, marked quick (tests/conftest.py)
# Any other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
if [ "${1:-}" = "--quick" ]; then
    shift
    exec python -m pytest -q -m quick tests "$@"
fi
# Two workers (pytest-xdist), a test module at a time each (--dist loadscope: a module's fixtures, such as a cluster of
# daemons, live in one worker): the suite mostly waits for real training steps, so two at once fit on two cores.
# ODP_TEST_WORKERS=0 runs it in one process.
exec python -m pytest -q -n "${ODP_TEST_WORKERS:-2}" --dist loadscope tests "$@"
