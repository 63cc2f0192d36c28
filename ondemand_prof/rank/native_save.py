"""The GIL-free trace save: kineto's ProfilerResult::save called from C++ with the GIL released (issue 20).

torch binds `ProfilerResult.save` (behind `export_chrome_trace`) without releasing the GIL, so a trace written on
our exporter thread stops the training thread for the whole write (33 ms for a 5.5 MB CPU trace, seconds for a
large GPU window). `_native/odp_save.cpp` (about 40 lines) calls the same C++ method with the GIL released, on a
thread that first lowers its own priority: the file is the one export_chrome_trace writes, byte for byte.

It is compiled with the host's C++ compiler against the installed torch's headers (no network), once per user,
torch build, Python and source, and kept in a cache directory we create 0700 and check at every use
($XDG_CACHE_HOME/ondemand_prof/native, default ~/.cache/ondemand_prof/native):
  * at install: `python -m ondemand_prof.rank.native_save build` (prints what it did; exit 1 when it cannot), or
  * in the background the first time a torch window opens in a process (`prepare()`): a child at idle priority,
    in its own session so that it finishes (and caches) even if the rank ends first; the ranks of a host build
    once (a lock); a failed build is not retried until the source, torch or Python change (the `build` command
    retries). Until the module is there, traces are written in-process, as before.
A cached module is loaded only when it is a regular file of ours that nobody else can write, in the checked
directory, named for the current key, and reports the torch version and source key it was built for.
Nothing here raises into training: every failure is a reason string and the pure-Python save.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

from ..core.safedir import UnsafeDirectory, ensure_private_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "_native" / "odp_save.cpp"
MODULE_NAME = "odp_save"  # PyInit_odp_save: the name the source is compiled with (TORCH_EXTENSION_NAME)
BUILD_TIMEOUT_S = 600.0  # a compile at idle priority on busy cores is slow (15 s quiet on 2 cores, 650 MB)
LOCK_FILE = ".build.lock"


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ondemand_prof" / "native"


def build_key() -> str:
    """What a built module depends on: the source, torch's exact build, the Python ABI and the machine."""
    import torch

    parts = [SOURCE.read_bytes(), torch.__version__.encode(), str(getattr(torch.version, "git_version", "")).encode(),
             str(sys.implementation.cache_tag).encode(), platform.machine().encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:20]


def module_path(root: Path, key: str) -> Path:
    return root / f"{MODULE_NAME}-{key}.so"


# ----------------------------------------------------------------------------------------------------------
# Loading: only what we built, for this torch


def load(root: Path | None = None) -> tuple[Any | None, str]:
    """(module, "") when a matching module is cached, else (None, why not). Never raises."""
    try:
        import torch

        root = root or cache_root()
        key = build_key()
        path = module_path(root, key)
        problem = _file_problem(root, path)
        if problem:
            return None, problem
        spec = importlib.util.spec_from_file_location(
            MODULE_NAME, path, loader=importlib.machinery.ExtensionFileLoader(MODULE_NAME, str(path)))
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)  # type: ignore[union-attr]
        if getattr(mod, "torch_version", None) != torch.__version__ or getattr(mod, "source_key", None) != key:
            return None, (f"{path} was built for torch {getattr(mod, 'torch_version', '?')} (key "
                          f"{getattr(mod, 'source_key', '?')}), not torch {torch.__version__} (key {key})")
        return mod, ""
    except Exception as exc:  # noqa: BLE001 - ImportError (ABI), OSError (dlopen), anything: the Python save
        return None, f"{type(exc).__name__}: {exc}"


def _file_problem(root: Path, path: Path) -> str | None:
    """Why `path` must not be loaded (None: load it): the directory is checked as every directory of ours is
    (core/safedir), the file must be a regular file we own that nobody else can write."""
    if not root.exists():
        return f"{root} does not exist (nothing built yet)"
    try:
        ensure_private_dir(root)
    except (UnsafeDirectory, OSError) as exc:
        return str(exc)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        failed = path.with_suffix(".failed")
        return f"the build failed before: {_first_line(failed)}" if failed.exists() else f"{path} is not built yet"
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file"
    if st.st_uid != os.getuid():
        return f"{path} belongs to uid {st.st_uid}, not to us (uid {os.getuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by others (mode {st.st_mode & 0o7777:o})"
    return None


def _first_line(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip().splitlines()[0][:300]
    except (OSError, IndexError):
        return "no reason recorded"


# ----------------------------------------------------------------------------------------------------------
# Building (in a child process: `python -m ondemand_prof.rank.native_save build`)


def compile_command(out: Path, key: str, std: str) -> list[str]:
    """g++ (or $CXX) against the installed torch's headers and libraries, with torch's ABI settings."""
    import torch
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or "c++"
    with warnings.catch_warnings():  # torch 2.9+ warns that pybind11 handles its ABI itself (and returns [])
        warnings.simplefilter("ignore")
        abi_flags = getattr(cpp_extension, "_get_pybind11_abi_build_flags", lambda: [])()  # pybind11's registry
    cmd = [cxx, "-O2", "-shared", "-fPIC", f"-std={std}", "-fvisibility=hidden",
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", *abi_flags,
           f"-DTORCH_EXTENSION_NAME={MODULE_NAME}", "-DTORCH_API_INCLUDE_EXTENSION_H",
           f'-DODP_TORCH_VERSION="{torch.__version__}"', f'-DODP_SOURCE_KEY="{key}"',
           *[f"-I{p}" for p in cpp_extension.include_paths()], f"-I{sysconfig.get_paths()['include']}",
           str(SOURCE), *[f"-L{p}" for p in cpp_extension.library_paths()],
           "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python", "-o", str(out)]
    return cmd


def build(root: Path | None = None, *, wait_for_others_s: float = BUILD_TIMEOUT_S) -> tuple[bool, str]:
    """Build the module into the cache unless it is there. (ok, what happened). One builder per cache (a lock);
    the output is written under a temporary name and renamed, so a reader never loads half a file."""
    root = root or cache_root()
    try:
        ensure_private_dir(root)
    except (UnsafeDirectory, OSError) as exc:
        return False, f"cache directory refused: {exc}"
    key = build_key()
    final = module_path(root, key)
    lock_fd = os.open(root / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        if not _lock(lock_fd, wait_for_others_s):
            return False, "another process is still building it"
        if final.exists():
            return True, f"already built: {final}"
        ok, message = _compile(root, key, final)
        failed = final.with_suffix(".failed")
        if ok:
            failed.unlink(missing_ok=True)
        else:
            failed.write_text(message + "\n", encoding="utf-8")
        return ok, message
    finally:
        os.close(lock_fd)


def _lock(fd: int, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.5)


def _compile(root: Path, key: str, final: Path) -> tuple[bool, str]:
    fd, tmp_name = tempfile.mkstemp(prefix=f".{MODULE_NAME}-", suffix=".so.tmp", dir=root)
    os.close(fd)
    tmp = Path(tmp_name)
    errors = []
    try:
        for std in ("c++20", "c++17"):  # torch 2.9+ needs C++20; older headers are C++17
            started = time.monotonic()
            try:
                proc = subprocess.run(compile_command(tmp, key, std), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, timeout=BUILD_TIMEOUT_S)
            except (OSError, subprocess.TimeoutExpired) as exc:
                return False, f"compiler could not run: {exc}"
            if proc.returncode == 0:
                os.chmod(tmp, 0o700)
                os.replace(tmp, final)
                return True, f"built {final} in {time.monotonic() - started:.0f} s (-std={std})"
            errors.append(f"-std={std}: exit {proc.returncode}: {_error_line(proc.stdout)}")
        return False, "compile failed: " + "; ".join(errors)
    finally:
        tmp.unlink(missing_ok=True)


def _error_line(output: str) -> str:
    lines = [line for line in output.splitlines() if "error" in line.lower()] or output.splitlines()[-1:]
    return lines[0][:300] if lines else "no output"


# ----------------------------------------------------------------------------------------------------------
# In a training process: one loader per process


class NativeSaver:
    """The process's view of the module: loaded once, or built in the background first."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._module: Any = None
        self._reason = "not prepared"
        self._thread: threading.Thread | None = None
        self._tried = threading.Event()  # the first load attempt is over (a build may still be running)

    def prepare(self, build_missing: bool = True) -> None:
        """Start loading (and, when missing and not failed before, building) in the background. Cheap, once."""
        with self._lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._prepare, args=(build_missing,),
                                            name="ondemand-prof-native", daemon=True)
            self._thread.start()

    def module(self, wait_s: float = 0.0) -> Any | None:
        """The loaded module, or None (then `reason` says why). Waits up to wait_s for prepare()'s first load
        attempt (a load takes milliseconds), never for a build: until one ends, traces are written in-process."""
        if self._thread is not None and wait_s > 0:
            self._tried.wait(wait_s)
        return self._module

    @property
    def reason(self) -> str:
        return self._reason

    def _prepare(self, build_missing: bool) -> None:
        try:
            mod, why = load()
            self._module, self._reason = mod, why
            self._tried.set()
            if mod is None and build_missing and "not built yet" in why and _compiler_present():
                self._reason = "being built in the background"
                why = _build_in_child()
                if not why:
                    mod, why = load()
            self._module, self._reason = mod, why
            if mod is None:
                log.info("ondemand_prof: GIL-free trace save unavailable (%s); traces are written in-process",
                         why)
        except Exception as exc:  # noqa: BLE001 - a background thread of the training process: log, never raise
            self._reason = f"{type(exc).__name__}: {exc}"
            log.info("ondemand_prof: GIL-free trace save unavailable (%s)", self._reason)
        finally:
            self._tried.set()


def _compiler_present() -> bool:
    return bool(os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++"))


def _build_in_child() -> str:
    """Run the build command in its own session at idle priority; "" when it built, else why not."""
    from .trace_save import lower_priority

    env = dict(os.environ)
    package_parent = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = package_parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    try:
        proc = subprocess.Popen([sys.executable, "-m", "ondemand_prof.rank.native_save", "build", "--idle"],
                                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    except OSError as exc:
        return f"could not start the build: {exc}"
    lower_priority(proc.pid)
    try:
        out, _ = proc.communicate(timeout=BUILD_TIMEOUT_S + 60)
    except subprocess.TimeoutExpired:
        return "the build did not finish in time"  # it goes on in its own session and caches for next time
    return "" if proc.returncode == 0 else (out.strip().splitlines() or ["build failed"])[-1]


SAVER = NativeSaver()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ondemand_prof.rank.native_save",
                                     description="Build or check ondemand_prof's GIL-free trace save.")
    parser.add_argument("command", choices=["build", "check"])
    parser.add_argument("--idle", action="store_true", help="build at idle priority (what a rank starts)")
    args = parser.parse_args(argv)
    if args.idle:
        from .trace_save import lower_priority

        lower_priority(0)  # the compiler inherits it
    if args.command == "build":
        ok, message = build()
        print(message)
        if not ok:
            return 1
    mod, why = load()
    print(f"loads: {mod is not None}{'' if mod is not None else ' (' + why + ')'}; cache {cache_root()}")
    return 0 if mod is not None else 1


if __name__ == "__main__":
    sys.exit(main())
