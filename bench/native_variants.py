"""Variants of the native save module for benchmarks (never used by a rank): the same source compiled with a
bench-only define, cached under the bench's own directory, loaded in place of the module a rank would load.

    inplace    the shipped module: the result's contents destroyed and an empty result constructed in place,
               on the job thread (the caller's priority), off the GIL
    accessors  the events and the event tree moved out through the public accessors and freed on the job thread;
               kineto's trace stays in the result and is freed by Python, under the GIL, when the result is dropped
    keep       nothing freed by the module (all of it under the GIL when the result is dropped)

Import from a bench script (bench/ on sys.path): use_variant(name) in the process measured, after building
with build_variants() (in the parent: compiling takes 20-60 s).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFINES = {"inplace": [], "accessors": ["-DODP_BENCH_FREE_BY_ACCESSORS"], "keep": ["-DODP_BENCH_KEEP_CONTENTS"]}
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ondemand_prof" / "bench-variants"


def variant_path(name: str) -> Path:
    from ondemand_prof.rank import native_save

    return CACHE / f"{native_save.MODULE_NAME}-{native_save.build_key()}-{name}.so"


def build_variants(names: list[str]) -> None:
    """Compile each variant not built yet for this source and torch (prints what it did)."""
    from ondemand_prof.rank import native_save

    CACHE.mkdir(parents=True, exist_ok=True, mode=0o700)
    for name in names:
        out = variant_path(name)
        if name == "inplace" or out.exists():
            continue
        cmd = native_save.compile_command(out, native_save.build_key(), "c++20")
        cmd[1:1] = DEFINES[name]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"variant {name} failed to build: {proc.stderr[-2000:]}")
        print(f"native variant {name}: built {out}", flush=True)


_loaded: dict[str, Any] = {}


def use_variant(name: str) -> Any:
    """Load variant `name` and make it the module this process's native saves use ("inplace": the shipped one)."""
    import importlib.machinery
    import importlib.util

    from ondemand_prof.rank import native_save

    if "inplace" not in _loaded:
        module = native_save.SAVER.module(build_missing=False)
        assert module is not None, native_save.SAVER.reason
        _loaded["inplace"] = module
    if name in _loaded:
        native_save.SAVER._module, native_save.SAVER._tried = _loaded[name], True
        return _loaded[name]
    path = variant_path(name)
    loader = importlib.machinery.ExtensionFileLoader(native_save.MODULE_NAME, str(path))
    spec = importlib.util.spec_from_file_location(native_save.MODULE_NAME, path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    _loaded[name] = module
    native_save.SAVER._module, native_save.SAVER._tried = module, True
    return module
