"""Variants of the native save module for benchmarks (never used by a rank): the same source compiled with a
bench-only define, cached under the bench's own directory, loaded in place of the module a rank would load.

    inplace    the shipped module: once the trace is saved, the result's contents freed on the job thread (the
               caller's priority), off the GIL, paced (slices of about 0.5 ms, rests three times as long), and an
               empty result constructed in place
    atonce     the same in one burst (shipped until 2026-12-07)
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

DEFINES = {"inplace": [], "accessors": ["-DODP_BENCH_FREE_BY_ACCESSORS"], "keep": ["-DODP_BENCH_KEEP_CONTENTS"],
           "atonce": ["-DODP_BENCH_FREE_AT_ONCE"]}
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
    """Load variant `name` and make it the module this process's native saves use ("inplace": the shipped one).

    One variant a process: a second extension module named odp_save loaded beside the first is the first (its
    init returns the module already made), so until 2026-12-06 every variant asked for after the shipped module
    had been loaded (this function loaded it first) silently ran the shipped code: ours-keep and ours-accessors
    measured the shipped module. A second, different variant is now refused."""
    import importlib.machinery
    import importlib.util

    from ondemand_prof.rank import native_save

    if name in _loaded:
        native_save.SAVER._module, native_save.SAVER._tried = _loaded[name], True
        return _loaded[name]
    if _loaded:
        raise RuntimeError(f"native variant {next(iter(_loaded))} is loaded in this process: {name} would be it "
                           "again (one variant a process)")
    if name == "inplace":
        module = native_save.SAVER.module(build_missing=False)
        assert module is not None, native_save.SAVER.reason
    else:
        path = variant_path(name)
        loader = importlib.machinery.ExtensionFileLoader(native_save.MODULE_NAME, str(path))
        spec = importlib.util.spec_from_file_location(native_save.MODULE_NAME, path, loader=loader)
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        assert module.__file__ == str(path), f"{name}: loaded {module.__file__} instead of {path}"
    _loaded[name] = module
    native_save.SAVER._module, native_save.SAVER._tried = module, True
    return module


# ----------------------------------------------------------------------------------------------------------
# python bench/native_variants.py [--repeat 5] [--steps 20]: what each variant leaves to be freed under the GIL


CHILD = r"""
import gc, json, sys, time
from pathlib import Path
import torch
from torch.autograd.profiler import record_function
sys.path.insert(0, sys.argv[1])
import native_variants
from ondemand_prof.rank import trace_save

torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True, record_shapes=True)
prof.prepare_trace()
prof.start_trace()
for step in range(int(sys.argv[3])):
    with record_function(f"ProfilerStep#{step}"):
        model(torch.randn(16, 64)).sum().backward()
prof.stop_trace()
native_variants.use_variant(sys.argv[2])
path = Path(sys.argv[4])
t0 = time.perf_counter()
how = trace_save.save_trace(prof.export_chrome_trace, path, kineto_result=lambda: prof.profiler.kineto_results)
t1 = time.perf_counter()
trace_save.wait_for_native_frees(120)  # the module frees after the save (paced): what it leaves is measured below
# The result's last reference, dropped alone: `del prof` freed nothing (0.0 ms for every variant, keep included,
# until 2026-12-07: the profile sits in reference cycles, which gc.disable() left), so the profile is collected
# first, untimed, and then the result, which holds no cycle, is timed as its reference goes
result = prof.profiler.kineto_results
del prof
gc.collect()
refs = sys.getrefcount(result) - 1  # 1: only `result`
gc.disable()
t2, c2 = time.perf_counter(), time.thread_time()
del result  # what is left of the result is freed here, holding the GIL
t3, c3 = time.perf_counter(), time.thread_time()
print(json.dumps({"how": how, "save_ms": (t1 - t0) * 1e3, "drop_ms": (t3 - t2) * 1e3, "drop_cpu_ms": (c3 - c2) * 1e3,
                  "mb": path.stat().st_size / 1e6, "refs": refs}))
"""


def main() -> None:
    import argparse
    import json
    import statistics
    import tempfile

    parser = argparse.ArgumentParser(description="What each way of freeing leaves to Python (under the GIL)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--variants", default="inplace,accessors,keep")
    args = parser.parse_args()
    names = args.variants.split(",")
    build_variants(names)
    rows: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):
            for name in names:
                out = Path(tmp) / f"{name}-{i}.json"
                env = dict(os.environ, PYTHONPATH=str(ROOT))
                proc = subprocess.run([sys.executable, "-c", CHILD, str(Path(__file__).parent), name, str(args.steps),
                                       str(out)], env=env, capture_output=True, text=True, timeout=600)
                if proc.returncode != 0:
                    raise RuntimeError(proc.stderr[-2000:])
                rows[name].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(f"{args.steps}-step window, with_stack + record_shapes, CPU; medians (min-max) of {args.repeat} processes; "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| variant | saved as | trace MB | save ms (the exporter waits, GIL free) | dropping the profile: wall ms, "
          "CPU ms (GIL held) |")
    print("|---|---|---|---|---|")
    for name, rs in rows.items():
        def span(key: str) -> str:
            vals = [r[key] for r in rs]
            return f"{statistics.median(vals):.1f} ({min(vals):.1f}-{max(vals):.1f})"
        print(f"| {name} | {rs[0]['how']} | {statistics.median(r['mb'] for r in rs):.1f} | {span('save_ms')} | "
              f"{span('drop_ms')}, {span('drop_cpu_ms')} |")


if __name__ == "__main__":
    main()
