"""ondemand_prof: an on-demand profiler for PyTorch training jobs (torch.profiler and torch_npu)."""

from .core.version import __version__
from .core.options import ConfigError, ProfileConfig, add_profile_args, config_from_args, config_from_env, \
    config_from_mapping
from .rank.hook import OnDemandProfiler
from .core.window import Window, WindowOptions
from .integrations.zerocode import enable

__all__ = [
    "__version__",
    "ConfigError",
    "OnDemandProfiler",
    "ProfileConfig",
    "Window",
    "WindowOptions",
    "add_profile_args",
    "enable",
    "config_from_args",
    "config_from_env",
    "config_from_mapping",
]
