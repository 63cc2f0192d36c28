"""ondemand_prof: an on-demand profiler for PyTorch training jobs (torch.profiler and torch_npu)."""

__version__ = "0.1.0"

from .core.options import ConfigError, ProfileConfig, add_profile_args, config_from_args, config_from_env, \
    config_from_mapping  # noqa: E402
from .rank.hook import OnDemandProfiler  # noqa: E402
from .core.window import Window, WindowOptions  # noqa: E402
from .integrations.zerocode import enable  # noqa: E402

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
