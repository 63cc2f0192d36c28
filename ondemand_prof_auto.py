"""Zero-code start-up hook: with ONDEMAND_PROF_AUTO=1, every Python process that imports torch counts a
training step at each optimizer step (ondemand_prof.integrations.zerocode), with no edit to the script.

Run at interpreter start-up by ondemand_prof_auto.pth (installed next to this module in site-packages), which
imports this module only when ONDEMAND_PROF_AUTO is set. It stays tiny on purpose: it never imports torch or
ondemand_prof itself. A meta path finder waits for `import torch` (a bare find_spec("torch"), which datasets,
evaluate and transformers ask at import, is not one: it stays for the import); once torch has finished importing,
one global optimizer post-step hook is registered, and ondemand_prof is imported (its profiler made) at once in a
rank its launcher started (RANK and WORLD_SIZE set, not a multiprocessing child), else when the process shows it
trains: init_process_group called (before its rendezvous; right after it where RANK is unset), an optimizer made, a
forward with gradients, the first optimizer step. So a process that never imports torch pays nothing, and one that
never trains (torchrun's agent, Lightning's or Accelerate's launcher, a DataLoader worker) neither counts steps nor
registers anywhere.
"""

from __future__ import annotations

import os
import sys

ENV = "ONDEMAND_PROF_AUTO"


def wanted(environ: "os._Environ[str] | dict[str, str] | None" = None) -> bool:
    value = (os.environ if environ is None else environ).get(ENV, "").strip().lower()
    return value not in ("", "0", "false", "no", "off")


class _TorchWatcher:
    """A meta path finder (any object with find_spec will do: importlib.abc's base class alone cost every
    process 15 ms at start-up) that finds nothing itself: when `torch` is looked up, wraps the loader of the spec
    the finders after it return, so that install_hook runs right after torch's own module code.

    It stays in sys.meta_path until a wrapped exec_module really runs: `importlib.util.find_spec("torch")` alone
    (datasets, evaluate and transformers ask it at import, to see whether torch is there, and throw the spec away)
    imports nothing. Should torch be imported past it all the same (an import hook ahead of it that loads torch
    itself, a loader whose exec_module cannot be wrapped), the next lookup after torch's import has finished hooks
    in late and says so on stderr, instead of nothing."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> object:
        if name != "torch":
            if "torch" in sys.modules:  # imported, and not through us (we leave sys.meta_path when it is)
                self._torch_came_past(name)
            return None
        meta_path = list(sys.meta_path)
        try:
            after = meta_path[meta_path.index(self) + 1:]  # the finders before us found nothing: importlib asks us
        except ValueError:
            return None
        spec = None
        for finder in after:  # what importlib does, without importing importlib.util
            if type(finder).__name__ == "_TorchWatcher":  # a second copy of this module's: one hook, not two
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        self._wrap(getattr(spec, "loader", None))
        return spec

    def _wrap(self, loader: object) -> None:
        """Make `loader` (this spec's own instance: path finders make one per lookup) run install_hook after
        torch's module code. A probe's spec is thrown away with its loader; the import's runs it."""
        real_exec = getattr(loader, "exec_module", None)
        if real_exec is None or getattr(real_exec, "_ondemand_prof", False):
            return

        def exec_module(module: object) -> None:
            if getattr(module, "__name__", None) != "torch":  # a loader that loads more than torch
                real_exec(module)
                return
            self.stop()  # torch's own imports (a thousand modules) pass no finder of ours
            try:
                real_exec(module)
            except BaseException:
                self.start()  # torch did not import: a later `import torch` is watched again
                raise
            install_hook()

        exec_module._ondemand_prof = True  # type: ignore[attr-defined]
        try:
            loader.exec_module = exec_module  # type: ignore[attr-defined]
        except (AttributeError, TypeError):  # a loader that takes no attributes: the late hook-in catches it
            pass

    def _torch_came_past(self, name: str) -> None:
        """torch is in sys.modules and our exec_module never ran: once its import has finished (the import
        system's own mark, spec._initializing False), hook in now and say so."""
        spec = getattr(sys.modules.get("torch"), "__spec__", None)
        if getattr(spec, "_initializing", True) is not False:  # still importing (or not a module importlib loaded)
            return
        if self.stop():  # one thread hooks in
            install_hook(late=name)

    def start(self) -> None:
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def stop(self) -> bool:
        """Leave sys.meta_path; whether it was there."""
        try:
            sys.meta_path.remove(self)
        except ValueError:
            return False
        return True


def _say(text: str) -> None:
    """One line for the user, as ondemand_prof.rank.announce.say does (imported here it would import the whole
    package inside an import): logged, and on stderr unless logging shows it or ONDEMAND_PROF_QUIET is set."""
    import logging

    log = logging.getLogger("ondemand_prof")
    log.info("%s", text)
    quiet = os.environ.get("ONDEMAND_PROF_QUIET", "").strip().lower() in ("1", "true", "yes", "on")
    if not quiet and not (log.isEnabledFor(logging.INFO) and log.hasHandlers()):
        _stderr(text)


def _stderr(text: str) -> None:
    """`text` and its newline in one write: stderr that is not a terminal writes through, and print() writes the
    newline apart, so two ranks sharing a log (torchrun's workers) can run their lines together."""
    try:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):  # a closed, broken or missing stderr must not reach the training
        pass


def _on_optimizer_step(optimizer: object, args: object, kwargs: object) -> None:
    """torch's global optimizer post-step hook: hand the step to zerocode (imported at the first step)."""
    try:
        from ondemand_prof.integrations import zerocode

        zerocode.auto_step(optimizer)
    except Exception:  # noqa: BLE001 - nothing of ours may reach the training loop
        import logging

        logging.getLogger("ondemand_prof").exception("ondemand_prof: zero-code step failed")


def _appeared(what: str) -> None:
    """A training process showed itself (torch.distributed came up, or an optimizer was made): the profiler is
    made now, so its start-up line says how to capture it before the first step, and it can say when no
    optimizer step comes."""
    try:
        from ondemand_prof.integrations import zerocode

        zerocode.auto_appeared(what)
    except Exception:  # noqa: BLE001 - nothing of ours may reach the training loop
        import logging

        logging.getLogger("ondemand_prof").exception("ondemand_prof: zero-code start failed")


def _after(owner: Any, name: str, what: str) -> None:
    """Wrap owner.name so that _appeared(what) runs once after its first call; the original is put back then."""
    original = getattr(owner, name, None)
    if original is None:
        return

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if getattr(owner, name, None) is wrapper:
            setattr(owner, name, original)
        _appeared(what)
        return result

    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(owner, name, wrapper)


def _watch_forward_with_grad(torch: Any) -> None:
    """A module's forward with gradients on: a training loop, even one that updates weights by hand (it makes no
    optimizer). Watched for the first 1000 forwards only (an inference process pays no more than that); torch
    iterates a snapshot of the global hooks, so the hook removes itself."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    seen = [0]

    def hook(module: Any, args: Any) -> None:
        seen[0] += 1
        training = torch.is_grad_enabled() and any(p.requires_grad for p in module.parameters())
        if training or seen[0] >= 1000:
            handle.remove()
        if training:
            _appeared("a module's forward with gradients")

    handle = register_module_forward_pre_hook(hook)


def _before(owner: Any, name: str, what: str) -> None:
    """Wrap owner.name so that _appeared(what) runs once before its first call (init_process_group: the rank is
    known to the daemon during the rendezvous, where a job hangs when a peer never comes), or right after it where
    the environment does not say the rank (no RANK: Lightning's DDP launcher and torch.multiprocessing.spawn pass
    `rank=` to the call): made before, every such rank would guess it is rank 0, and claim rank 0 of the job."""
    original = getattr(owner, name, None)
    if original is None:
        return

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if getattr(owner, name, None) is wrapper:
            setattr(owner, name, original)
        if not os.environ.get("RANK", "").isdigit():
            result = original(*args, **kwargs)
            _appeared(what)
            return result
        _appeared(what)
        return original(*args, **kwargs)

    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(owner, name, wrapper)


def launched_rank(environ: "os._Environ[str] | dict[str, str] | None" = None) -> bool:
    """Whether this process is a rank its launcher started (torchrun, a Slurm script: RANK and WORLD_SIZE set),
    not a child of one through multiprocessing (a DataLoader worker, which inherits that environment)."""
    environ = os.environ if environ is None else environ
    if not (environ.get("RANK", "").isdigit() and environ.get("WORLD_SIZE", "").isdigit()):
        return False
    mp = sys.modules.get("multiprocessing")  # torch has imported it; never imported here
    try:
        return mp is None or mp.parent_process() is None
    except Exception:  # noqa: BLE001 - an odd multiprocessing: take it as a child, as before
        return False


def _watch_for_training() -> None:
    """The first optimizer made, torch.distributed about to be initialised (under both names it is called by), or
    a forward with gradients; a rank its launcher started is made at once (with torch)."""
    import torch

    _after(torch.optim.Optimizer, "__init__", "an optimizer")
    _watch_forward_with_grad(torch)
    dist = getattr(torch, "distributed", None)
    if dist is not None and dist.is_available():
        from torch.distributed import distributed_c10d

        for owner in (dist, distributed_c10d):
            _before(owner, "init_process_group", "torch.distributed")


_installed = False


def install_hook(late: str | None = None) -> None:
    """Register the optimizer hook and the watchers (torch has finished importing). `late`: the module whose
    lookup found torch imported past our finder; the profiler is then made at the next sign of training (an
    optimizer made, init_process_group, a forward with gradients, the first optimizer step), not inside that
    import, and one line says what happened."""
    global _installed
    if _installed:
        return
    try:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(_on_optimizer_step)
        _installed = True
    except Exception as exc:  # noqa: BLE001 - a torch without global hooks (older than 2.0): say so, carry on
        _stderr(f"ondemand_prof: {ENV} is set but torch has no global optimizer hook: {exc}")
        return
    try:
        _watch_for_training()
    except Exception as exc:  # noqa: BLE001 - the line then comes at the first optimizer step, as before
        _stderr(f"ondemand_prof: {ENV}: cannot watch for the training process to start: {exc}")
    if late is not None:
        rank = os.environ.get("RANK", "")
        _say(f"ondemand_prof: {'rank ' + rank + ': ' if rank.isdigit() else ''}{ENV} is set but torch was "
             f"imported past its import hook (an import hook ahead of it in sys.meta_path, or a loader it could "
             f"not wrap); hooked in late, at the import of {late}: optimizer steps before that are not "
             "counted")
    elif launched_rank():  # registered from here on: through its rendezvous, its data loading, its first step
        _appeared("a rank its launcher started (RANK and WORLD_SIZE)")


def install() -> None:
    """Called by the .pth at start-up (only when ONDEMAND_PROF_AUTO is set)."""
    if not wanted():
        return
    if "torch" in sys.modules:
        install_hook()
    elif not any(type(f).__name__ == "_TorchWatcher" for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchWatcher())
