"""What ProfileConfig and WindowOptions do besides holding their fields (the fields come from the OPTIONS table:
core/config.py is generated from it)."""

from __future__ import annotations

import dataclasses
from typing import Any

from .ranks import selects


class ConfigMethods:
    def replace(self, **changes: Any) -> Any:
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]

    def selects_rank(self, rank: int) -> bool:
        """-1 anywhere in the list means every rank (MindSpeed compares the whole list to [-1])."""
        return selects(self.ranks, rank)  # type: ignore[attr-defined]


class WindowMethods:
    @classmethod
    def from_config(cls, config: Any, **overrides: Any) -> Any:
        values = {f.name: getattr(config, f.name) for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        values.update(overrides)
        return cls(**values)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]
