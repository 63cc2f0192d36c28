"""The GIL-free trace save: kineto's ProfilerResult::save called from C++ with the GIL released (issue 20).

torch binds `ProfilerResult.save` (behind `export_chrome_trace`) without releasing the GIL, so a trace written on
our exporter thread stops the training thread for the whole write (33 ms for a 5.5 MB CPU trace, seconds for a
large GPU window). `_native/odp_save.cpp` calls the same C++ method with the GIL released, on a thread that first
lowers its own priority: the file is the one export_chrome_trace writes, byte for byte. The result's contents are
then destroyed in place on a thread at the caller's priority (never at idle priority: those frees take the
training thread's malloc arena lock), and a process that exits meanwhile waits for the save (issue 31; the C++
file's header says how).

It is compiled with the host's C++ compiler against the installed torch's headers (no network), once per user,
torch build, Python and source, and kept in a cache directory we create 0700 and check at every use
($XDG_CACHE_HOME/ondemand_prof/native, default ~/.cache/ondemand_prof/native):
  * at install: `python -m ondemand_prof.rank.native_save build` (prints what it did; exit 1 when it cannot), or
  * in the background, when a process's first export finds no module (NativeSaver): a child at idle priority,
    in its own session so that it finishes (and caches) even if the rank ends first; the ranks of a host build
    once (a lock); a failed build is not retried until the source, torch or Python change (the `build` command
    retries). Until the module is there, traces are written in-process, as before.
A cached module is loaded only when it is a regular file of ours that nobody else can write, in the checked
directory, named for the current key, and reports the torch version and source key it was built for. The
directory is opened and checked at each load and build (core/safedir.open_dir: every directory above it sound, no
link followed), and the module, its lock and its `.failed` note are opened relative to that descriptor and
loaded through it (/proc/self/fd/N/name), never by a path someone could swap after the check (issue 34, F5).
Nothing here raises into training: every failure is a reason string and the pure-Python save.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Iterator

from ..core.files import write_atomic_at
from ..core.safedir import UnsafeDirectory, open_dir, read_at
from .helpers import CHILD_CWD, lower_priority, python_child

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
        dir_fd, problem = _checked_module(root, path)
        if dir_fd is None:
            return None, problem
        try:
            # the checked directory's descriptor names it from here on: the kernel resolves /proc/self/fd/N itself
            where = f"/proc/self/fd/{dir_fd}/{path.name}"
            origin = where if os.path.isdir(f"/proc/self/fd/{dir_fd}") else str(path)  # no /proc: just checked
            spec = importlib.util.spec_from_file_location(
                MODULE_NAME, origin, loader=importlib.machinery.ExtensionFileLoader(MODULE_NAME, origin))
            assert spec is not None and spec.loader is not None
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)  # type: ignore[union-attr]
        finally:
            os.close(dir_fd)
        if getattr(mod, "torch_version", None) != torch.__version__ or getattr(mod, "source_key", None) != key:
            return None, (f"{path} was built for torch {getattr(mod, 'torch_version', '?')} (key "
                          f"{getattr(mod, 'source_key', '?')}), not torch {torch.__version__} (key {key})")
        return mod, ""
    except Exception as exc:  # noqa: BLE001 - ImportError (ABI), OSError (dlopen), anything: the Python save
        return None, f"{type(exc).__name__}: {exc}"


def _checked_module(root: Path, path: Path) -> tuple[int | None, str]:
    """(the cache directory's descriptor, "") when `path` may be loaded, else (None, why not): the directory is
    checked as every directory of ours is (core/safedir.open_dir), the file, looked at relative to it without
    following a link, must be a regular file we own that nobody else can write. The caller closes the
    descriptor; nobody but us can change what the directory holds (it is ours, 0700, and so is the way to it)."""
    if not root.exists():
        return None, f"{root} does not exist: not built yet"
    try:
        dir_fd = open_dir(root, create=True)
    except OSError as exc:
        return None, str(exc)
    problem = _file_problem(dir_fd, path)
    if problem:
        os.close(dir_fd)
        return None, problem
    return dir_fd, ""


def _file_problem(dir_fd: int, path: Path) -> str | None:
    try:
        st = os.stat(path.name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        failed = read_at(dir_fd, path.with_suffix(".failed").name, 4096)
        return f"the build failed before: {_first_line(failed)}" if failed is not None else \
            f"{path} is not built yet"
    except OSError as exc:
        return f"cannot look at {path}: {exc.strerror}"
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file"
    if st.st_uid != os.getuid():
        return f"{path} belongs to uid {st.st_uid}, not to us (uid {os.getuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by others (mode {st.st_mode & 0o7777:o})"
    return None


def _first_line(raw: bytes) -> str:
    try:
        return raw.decode("utf-8", errors="replace").strip().splitlines()[0][:300]
    except IndexError:
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
        abi_flags: list[str] = getattr(cpp_extension, "_get_pybind11_abi_build_flags", lambda: [])()  # pybind11's registry
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
        dir_fd = open_dir(root, create=True)  # checked; everything below is relative to it
    except (UnsafeDirectory, OSError) as exc:
        return False, f"cache directory refused: {exc}"
    try:
        key = build_key()
        final = module_path(root, key)
        lock_fd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        try:
            if not _lock(lock_fd, wait_for_others_s):
                return False, "another process is still building it"
            if _exists(dir_fd, final.name):
                return True, f"already built: {final}"
            ok, message = _compile(root, dir_fd, key, final)
            failed = final.with_suffix(".failed").name
            if ok:
                try:
                    os.unlink(failed, dir_fd=dir_fd)
                except FileNotFoundError:
                    pass
            else:
                write_atomic_at(dir_fd, failed, message + "\n")
            return ok, message
        finally:
            os.close(lock_fd)
    finally:
        os.close(dir_fd)


def _exists(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False


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


def _compile(root: Path, dir_fd: int, key: str, final: Path) -> tuple[bool, str]:
    """The compiler writes a temporary name in the checked directory (by path: a compiler takes no descriptor;
    the way to it was checked and is ours); the result is checked and renamed relative to the descriptor."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{MODULE_NAME}-", suffix=".so.tmp", dir=f"/proc/self/fd/{dir_fd}"
                                    if os.path.isdir(f"/proc/self/fd/{dir_fd}") else root)
    os.close(fd)
    tmp = root / os.path.basename(tmp_name)
    errors = []
    try:
        for std in ("c++20", "c++17"):  # torch 2.9+ needs C++20; older headers are C++17
            started = time.monotonic()
            try:
                proc = subprocess.run(compile_command(tmp, key, std), stdout=subprocess.PIPE, cwd=CHILD_CWD,
                                      stderr=subprocess.STDOUT, text=True, timeout=BUILD_TIMEOUT_S)
            except (OSError, subprocess.TimeoutExpired) as exc:
                return False, f"compiler could not run: {exc}"
            if proc.returncode == 0:
                out = os.stat(tmp.name, dir_fd=dir_fd, follow_symlinks=False)
                if not stat.S_ISREG(out.st_mode) or out.st_uid != os.getuid():
                    return False, f"the compiler's output {tmp} is not a regular file of ours"
                os.chmod(tmp.name, 0o700, dir_fd=dir_fd)  # whatever the umask made it
                os.replace(tmp.name, final.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                return True, f"built {final} in {time.monotonic() - started:.0f} s (-std={std})"
            errors.append(f"-std={std}: exit {proc.returncode}: {_error_line(proc.stdout)}")
        return False, "compile failed: " + "; ".join(errors)
    finally:
        try:
            os.unlink(tmp.name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass


def _error_line(output: str) -> str:
    lines = [line for line in output.splitlines() if "error" in line.lower()] or output.splitlines()[-1:]
    return lines[0][:300] if lines else "no output"


# ----------------------------------------------------------------------------------------------------------
# In a training process: one loader per process


class NativeSaver:
    """The process's view of the module. Used on the exporter thread only, after a window's collection: no thread
    of its own, so that no Python code of ours runs while a window records (with_stack traces every thread's
    Python calls). The first use loads the module (milliseconds); when it is missing, it starts the build in the
    background and the traces are written in-process until a later use finds the module built."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._module: Any = None
        self._reason = "not loaded yet"
        self._tried = False
        self._build: subprocess.Popen | None = None

    def module(self, build_missing: bool = True) -> Any | None:
        """The loaded module, or None (then `reason` says why). Never raises, never waits for a build."""
        with self._lock:
            try:
                if self._module is None and self._should_load():
                    self._load(build_missing)
            except Exception as exc:  # noqa: BLE001 - the exporter thread: say why, write in-process
                self._reason = f"{type(exc).__name__}: {exc}"
            return self._module

    @property
    def reason(self) -> str:
        return self._reason

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """While a capture is post-processed: our build (its own process group, the compiler in it) is stopped,
        then continued. Both run at idle priority and would share the leftover CPU: a job's first capture, which
        starts the build, took seconds longer than later ones on tiny traces (issue 32)."""
        proc = self._build
        stopped = False
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGSTOP)
                stopped = True
            except OSError:
                pass
        try:
            yield
        finally:
            if stopped:
                try:
                    os.killpg(proc.pid, signal.SIGCONT)  # type: ignore[union-attr]
                except OSError:
                    pass

    def _should_load(self) -> bool:
        if not self._tried:
            return True
        if self._build is None or self._build.poll() is None:
            return False  # no build of ours (a failure is not retried), or ours still runs
        self._build = None
        return True  # our build has ended: look again

    def _load(self, build_missing: bool) -> None:
        self._tried = True
        self._module, self._reason = load()
        if self._module is not None or not build_missing or "not built yet" not in self._reason:
            if self._module is None:
                log.info("ondemand_prof: GIL-free trace save unavailable (%s); traces are written in-process",
                         self._reason)
            return
        if not compiler_present():
            self._reason += "; no C++ compiler to build it"
        elif building_elsewhere(cache_root()):
            self._reason = "another process is building it"
            self._tried = False  # look again at the next export
        else:
            self._build, why = _start_build()
            self._reason = why or "being built in the background; traces are written in-process until then"
        log.info("ondemand_prof: GIL-free trace save not loaded yet (%s)", self._reason)


def compiler_present() -> bool:
    """Whether a C++ compiler is there to try ($CXX, g++ or c++)."""
    return bool(os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++"))


def building_elsewhere(root: Path) -> bool:
    """Whether another process holds the build lock now (then that build is left to finish on its own)."""
    try:
        fd = os.open(root / LOCK_FILE, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also releases a lock taken here


def _start_build() -> tuple[subprocess.Popen | None, str]:
    """Start the build command at idle priority in its own session (it finishes, and caches, even if the rank ends
    first; its output goes nowhere: a failure is written beside the module as `.failed`)."""
    cmd, env = python_child("ondemand_prof.rank.native_save", "build", "--idle", "--no-wait")
    try:
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, cwd=CHILD_CWD,
                                stderr=subprocess.DEVNULL, start_new_session=True)
    except OSError as exc:
        return None, f"could not start the build: {exc}"
    lower_priority(proc.pid)
    return proc, ""


SAVER = NativeSaver()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ondemand_prof.rank.native_save",
                                     description="Build or check ondemand_prof's GIL-free trace save.")
    parser.add_argument("command", choices=["build", "check"])
    parser.add_argument("--idle", action="store_true", help="build at idle priority (what a rank starts)")
    parser.add_argument("--no-wait", action="store_true", help="give up at once when another process is building")
    args = parser.parse_args(argv)
    if args.idle:
        lower_priority(0)  # the compiler inherits it
        # a rank that dies while it holds our group stopped (NativeSaver.paused) leaves an orphaned group: the
        # kernel sends it SIGHUP then SIGCONT, and the build (compiler included: ignored stays ignored) goes on
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    if args.command == "build":
        ok, message = build(wait_for_others_s=0 if args.no_wait else BUILD_TIMEOUT_S)
        print(message)
        if not ok:
            return 1
    mod, why = load()
    print(f"loads: {mod is not None}{'' if mod is not None else ' (' + why + ')'}; cache {cache_root()}")
    return 0 if mod is not None else 1


if __name__ == "__main__":
    sys.exit(main())
