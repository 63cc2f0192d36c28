#!/usr/bin/env bash
# The GPU check (issue 33; README "Measured on a GPU"): every CUDA path of ondemand_prof in one run, one table.
#
#   bash scripts/gpu_check.sh [--device auto|cuda|cpu] [--out DIR] [--quick] [--budget-s S] [--keep]
#       runs bench/gpu_check.py; writes DIR/table.md, DIR/results.json, DIR/logs.tar.gz (default DIR:
#       $OUT/gpu_check where $OUT is set, else build/gpu_check); exit 0 when every row passed, 1 otherwise
#   bash scripts/gpu_check.sh --fetch-wheels [PYTHON_VERSION]
#       here, where pip reaches a registry: the wheels of the dependencies a bare torch image lacks (pyzmq,
#       watchdog; PyYAML and psutil too, in case) for CPython PYTHON_VERSION (default 3.12, the lent machine's)
#       on x86-64 Linux, into build/gpu_check_wheels (ignored by git: carry it to the machine)
#
# Which Python: $PYTHON, else the checkout's .venv when its python imports torch, else python3 (on the lent GPU
# machine: the image's python3, which holds torch with CUDA). Dependencies of ours that it lacks are installed
# from build/gpu_check_wheels (or $ODP_GPU_CHECK_WHEELS) into a temporary directory put on PYTHONPATH, never from
# the network. The run is bounded twice: the check's own budget (--budget-s, default 420 s) and, around it,
# `timeout` (budget + 60 s), so that nothing hangs.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${ODP_GPU_CHECK_WHEELS:-build/gpu_check_wheels}

if [ "${1:-}" = "--fetch-wheels" ]; then
    version=${2:-3.12}
    mkdir -p "$WHEELS"
    PY=${PYTHON:-python3}; [ -x .venv/bin/python ] && PY=.venv/bin/python
    # the versions this checkout's venv runs, where it has them (the lent machine then runs what the tests ran)
    pins=$("$PY" - <<'EOF'
from importlib import metadata
for name in ("pyzmq", "watchdog", "PyYAML", "psutil"):
    try:
        print(f"{name}=={metadata.version(name)}")
    except metadata.PackageNotFoundError:
        print(name)
EOF
)
    platforms=()
    for p in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 \
             manylinux_2_26 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
        platforms+=(--platform "${p}_x86_64")
    done
    # shellcheck disable=SC2086 # one argument per pin
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
        "${platforms[@]}" -d "$WHEELS" $pins
    ls -l "$WHEELS"
    echo "carry $WHEELS to the lent machine (run's carry: [\"$WHEELS\"])"
    exit 0
fi

has_torch='import importlib.util, sys; sys.exit(importlib.util.find_spec("torch") is None)'
if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON
elif [ -x .venv/bin/python ] && .venv/bin/python -c "$has_torch" 2>/dev/null; then
    PY=.venv/bin/python
else
    PY=python3
fi
if ! "$PY" -c "$has_torch" 2>/dev/null; then
    echo "gpu_check: $PY has no torch (set PYTHON to a Python with torch)" >&2
    exit 2
fi

missing=$("$PY" - <<'EOF'
import importlib.util
print(" ".join(m for m in ("zmq", "watchdog", "yaml", "psutil") if importlib.util.find_spec(m) is None))
EOF
)
if [ -n "$missing" ]; then
    shopt -s nullglob
    wheels=("$WHEELS"/*.whl)
    if [ ${#wheels[@]} -eq 0 ]; then
        echo "gpu_check: $PY lacks $missing and $WHEELS holds no wheels: run 'bash scripts/gpu_check.sh" \
             "--fetch-wheels' where pip reaches a registry, and carry $WHEELS along" >&2
        exit 2
    fi
    site=$(mktemp -d /tmp/odp-gpu-check-site.XXXXXX)
    trap 'rm -rf "$site"' EXIT
    # only what is missing: a wheel of a package the image already has would shadow the image's own
    keep=()
    for w in "${wheels[@]}"; do
        dist=$(basename "$w" | cut -d- -f1 | tr '[:upper:]' '[:lower:]')
        case "$dist" in pyzmq) module=zmq ;; pyyaml) module=yaml ;; *) module=$dist ;; esac
        case " $missing " in *" $module "*) keep+=("$w") ;; esac
    done
    if [ ${#keep[@]} -eq 0 ]; then
        echo "gpu_check: $PY lacks $missing and no wheel in $WHEELS provides it" >&2
        exit 2
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
        --target "$site" "${keep[@]}"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    still=$("$PY" -c "import importlib.util as u, sys
print(' '.join(m for m in sys.argv[1:] if u.find_spec(m) is None))" $missing)
    if [ -n "$still" ]; then
        echo "gpu_check: $still still missing after installing ${keep[*]} from $WHEELS (another Python version?)" >&2
        exit 2
    fi
    echo "gpu_check: installed from $WHEELS: $(basename -a "${keep[@]}" | tr '\n' ' ')"
fi

budget=420
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    [ "${args[$i]}" = "--budget-s" ] && budget=${args[$((i + 1))]:-420}
done
export PYTHONUNBUFFERED=1
# SIGTERM first (the check writes its table and stops what it started), SIGKILL 20 s later
timeout -k 20 "$(( ${budget%.*} + 60 ))" "$PY" bench/gpu_check.py "$@"
