#!/usr/bin/env bash
# The test suite: real processes (gloo ranks, daemon, CLI), real files. Run scripts/setup.sh first.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
exec python -m pytest -q tests "$@"
