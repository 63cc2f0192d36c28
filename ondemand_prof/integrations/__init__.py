"""Ready-made hook points for the training stacks people run: zero-code (optimizer steps), Lightning, Hugging
Face Trainer. Each takes the profiler options as keywords (the names of the options table, e.g.
`save_path="./profile", ranks=[0, 1]`, or their YAML keys, `profile_save_path=...`); ONDEMAND_PROF_* environment
variables override them, as they override flags and YAML.
"""

from __future__ import annotations

import difflib
from typing import Any, Mapping

from ..core.options import OPTION_BY_KEY, OPTION_BY_NAME, ConfigError, ProfileConfig, _build


def config_from_options(options: Mapping[str, Any], config: Any = None) -> Any:
    """A ProfileConfig from keyword options (on top of `config`, default ProfileConfig())."""
    values = {}
    for name, raw in options.items():
        opt = OPTION_BY_NAME.get(name) or OPTION_BY_KEY.get(name)
        if opt is None:
            close = difflib.get_close_matches(name, list(OPTION_BY_NAME), n=1)
            raise ConfigError(f"unknown profiler option {name!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                              + "; known options: " + ", ".join(OPTION_BY_NAME))
        if raw is not None:
            values[opt.name] = (raw, name)
    return _build(values, config if config is not None else ProfileConfig())


__all__ = ["config_from_options"]
