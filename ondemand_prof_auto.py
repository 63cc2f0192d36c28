"""Zero-code start-up hook: with ONDEMAND_PROF_AUTO=1, every Python process that imports torch counts a
training step at each optimizer step (ondemand_prof.integrations.zerocode), with no edit to the script.

Run at interpreter start-up by ondemand_prof_auto.pth (installed next to this module in site-packages), which
imports this module only when ONDEMAND_PROF_AUTO is set. It stays tiny on purpose: it never imports torch or
ondemand_prof itself. A meta path finder waits for `import torch`; once torch has finished importing, one
global optimizer post-step hook is registered, and ondemand_prof is imported (its profiler made) at once in a
rank its launcher started (RANK and WORLD_SIZE set, not a multiprocessing child), else when the process shows it
trains: init_process_group called (before its rendezvous), an optimizer made, a forward with gradients, the first
optimizer step. So a process that never imports torch pays nothing, and one that never trains (torchrun's agent,
Lightning's or Accelerate's launcher, a DataLoader worker) neither counts steps nor registers anywhere.
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
    process 15 ms at start-up) that finds nothing itself: when `torch` is about to be imported, wraps its
    loader so that install_hook runs right after torch's own module code."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> object:
        if name != "torch":
            return None
        try:
            sys.meta_path.remove(self)  # once: the real finders locate torch
        except ValueError:
            return None
        spec = None
        for finder in sys.meta_path:  # what importlib does, without importing importlib.util
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        real_exec = loader.exec_module

        def exec_module(module: object) -> None:
            real_exec(module)
            install_hook()

        loader.exec_module = exec_module  # this spec's own loader instance (a SourceFileLoader)
        return spec


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
    known to the daemon during the rendezvous, where a job hangs when a peer never comes)."""
    original = getattr(owner, name, None)
    if original is None:
        return

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if getattr(owner, name, None) is wrapper:
            setattr(owner, name, original)
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


def install_hook() -> None:
    global _installed
    if _installed:
        return
    try:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(_on_optimizer_step)
        _installed = True
    except Exception as exc:  # noqa: BLE001 - a torch without global hooks (older than 2.0): say so, carry on
        print(f"ondemand_prof: {ENV} is set but torch has no global optimizer hook: {exc}", file=sys.stderr)
        return
    try:
        _watch_for_training()
    except Exception as exc:  # noqa: BLE001 - the line then comes at the first optimizer step, as before
        print(f"ondemand_prof: {ENV}: cannot watch for the training process to start: {exc}", file=sys.stderr)
    if launched_rank():  # registered from here on: through its rendezvous, its data loading, its first step
        _appeared("a rank its launcher started (RANK and WORLD_SIZE)")


def install() -> None:
    """Called by the .pth at start-up (only when ONDEMAND_PROF_AUTO is set)."""
    if not wanted():
        return
    if "torch" in sys.modules:
        install_hook()
    elif not any(isinstance(f, _TorchWatcher) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchWatcher())
