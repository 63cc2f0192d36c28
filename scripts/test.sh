#!/usr/bin/env bash
# The test suite: real processes (gloo ranks, daemon, CLI), real files. Run scripts/setup.sh first.
#   bash scripts/test.sh            the full suite (what CI runs)
#   bash scripts/test.sh --quick    the quick tier: in-process tests only (tests/conftest.py QUICK_MODULES)
# Any other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
if [ "${1:-}" = "--quick" ]; then
    shift
    exec python -m pytest -q -m quick tests "$@"
fi
exec python -m pytest -q tests "$@"
