"""Profiler backends: torch.profiler (torch_backend.py) and torch_npu (npu.py); what they share is in base.py."""

from __future__ import annotations

import importlib.util

from .base import Backend, Export, Identity, Session, Written

__all__ = ["Backend", "Export", "Identity", "Session", "Written", "npu_available", "select_backend"]


def npu_available() -> bool:
    """torch_npu is importable; we never import it unless it is installed."""
    return importlib.util.find_spec("torch_npu") is not None


def select_backend(prefer: str = "auto") -> Backend:
    if prefer in ("npu",) or (prefer == "auto" and npu_available()):
        from .npu import NpuBackend

        return NpuBackend()
    from .torch_backend import TorchBackend

    return TorchBackend()
