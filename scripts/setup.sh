#!/usr/bin/env bash
# Create .venv (if missing) with torch (CPU build pinned first: an open range would pull a multi-GB CUDA
# build), then the project and its test dependencies.
#   bash scripts/setup.sh           the project and the test extra (what the tests and CI need: HTA with jupyterlab
#                                   and plotly, Lightning, transformers, mkdocs, ...: minutes to install)
#   bash scripts/setup.sh --demo    the project alone: what `python -m ondemand_prof.demo` needs (torch, pyzmq,
#                                   watchdog, psutil, PyYAML); run without --demo later to add the test extra
set -euo pipefail
cd "$(dirname "$0")/.."
target=".[test]"
case "${1:-}" in
    "") ;;
    --demo) target="." ;;
    *) echo "usage: bash scripts/setup.sh [--demo]" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
python -m pip install -q -e "$target"
