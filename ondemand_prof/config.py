"""One ProfileConfig, parsed from command-line flags, a training YAML, or the environment.

Every option is declared once in OPTIONS; the argparse flags, the YAML keys under ``training:`` and the
``ONDEMAND_PROF_*`` environment variables are all derived from that table, so the three surfaces cannot
drift apart. Names and defaults of the first twelve follow MindSpeed LLM (MCore flags, FSDP2 YAML keys).
This module is pure: it does no I/O besides reading a YAML file when given a path.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

LEVELS = ("level_none", "level0", "level1", "level2")
EXPORT_TYPES = ("text", "db")
ENV_PREFIX = "ONDEMAND_PROF_"


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the flag/key, the value and what is accepted."""


@dataclass(frozen=True)
class ProfileConfig:
    """Everything the profiler hook needs to know; see README "Configuration reference"."""

    # --- the twelve MindSpeed LLM options ---
    enabled: bool = False
    step_start: int = 0
    step_end: int = -1
    ranks: tuple[int, ...] = (0,)
    level: str = "level0"
    export_type: str = "text"
    data_simplification: bool = False
    with_cpu: bool = False
    with_stack: bool = False
    with_memory: bool = False
    record_shapes: bool = False
    save_path: str = "./profile"
    # --- ours ---
    warmup_steps: int = 1
    gzip: bool = False
    job_id: str = ""
    max_window_steps: int = 200
    ondemand: bool = True
    ondemand_steps: int = 2
    trigger_dir: str = ""
    trigger_poll_s: float = 0.0
    signal: str = ""
    daemon: bool = True
    runtime_dir: str = ""
    export_timeout_s: float = 120.0
    min_free_mb: int = 256

    def replace(self, **changes: Any) -> "ProfileConfig":
        return dataclasses.replace(self, **changes)

    def selects_rank(self, rank: int) -> bool:
        """-1 anywhere in the list means every rank (MindSpeed compares the whole list to [-1])."""
        return -1 in self.ranks or rank in self.ranks

    @property
    def bounded(self) -> bool:
        return self.step_end != -1


# ----------------------------------------------------------------------------------------------------------
# Parsing of single values. Each parser takes the raw value (a string from argv/env, or a YAML scalar/list)
# and the label of where it came from, and returns the typed value or raises ConfigError.


def _err(label: str, value: Any, accepted: str) -> ConfigError:
    return ConfigError(f"invalid {label} {value!r}: expected {accepted}")


def parse_bool(value: Any, label: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off", ""):
        return False
    raise _err(label, value, "true or false")


def parse_int(value: Any, label: str) -> int:
    if isinstance(value, bool):
        raise _err(label, value, "an integer")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise _err(label, value, "an integer")


def parse_float(value: Any, label: str) -> float:
    if isinstance(value, bool):
        raise _err(label, value, "a number")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            pass
    raise _err(label, value, "a number")


def parse_ranks(value: Any, label: str) -> tuple[int, ...]:
    """Accepts 3, "3", "0,1", "0 1", [0, 1], ["0", "1"]; -1 means all ranks."""
    if isinstance(value, (list, tuple)):
        items = list(value)
    elif isinstance(value, str):
        items = value.replace(",", " ").split()
    else:
        items = [value]
    if not items:
        raise _err(label, value, "a list of integer ranks (-1 = all)")
    ranks = []
    for item in items:
        try:
            rank = parse_int(item, label)
        except ConfigError:
            raise _err(label, value, "a list of integer ranks (-1 = all)") from None
        if rank < -1:
            raise _err(label, value, "ranks >= 0, or -1 for all ranks")
        ranks.append(rank)
    return tuple(dict.fromkeys(ranks))


def _choice(choices: tuple[str, ...]) -> Callable[[Any, str], str]:
    def parse(value: Any, label: str) -> str:
        text = str(value).strip().lower() if isinstance(value, str) else value
        if text not in choices:
            raise _err(label, value, "one of " + ", ".join(choices))
        return text

    return parse


def parse_str(value: Any, label: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise _err(label, value, "a string")
    return str(value)


# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Option:
    field: str  # ProfileConfig attribute
    key: str  # YAML key under training:, also the argparse dest (Megatron's names)
    parse: Callable[[Any, str], Any]
    help: str
    env: str = ""  # ONDEMAND_PROF_<env>; derived from key when empty
    yaml_default: Any = None  # FSDP2 YAML default when it differs from the MCore default
    ours: bool = False  # not a MindSpeed option

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    @property
    def env_var(self) -> str:
        return ENV_PREFIX + (self.env or self.key.removeprefix("profile_").upper())

    @property
    def default(self) -> Any:
        return getattr(ProfileConfig(), self.field)


OPTIONS: tuple[Option, ...] = (
    Option("enabled", "profile", parse_bool, "Enable the static profiling window.", env="ENABLE"),
    Option("step_start", "profile_step_start", parse_int, "First step recorded (inclusive)."),
    Option("step_end", "profile_step_end", parse_int, "Step at which recording stops (exclusive); -1 = until close()."),
    Option("ranks", "profile_ranks", parse_ranks, "Ranks that profile; -1 anywhere = all ranks.", yaml_default=(-1,)),
    Option("level", "profile_level", _choice(LEVELS), "Collection level: " + ", ".join(LEVELS) + "."),
    Option("export_type", "profile_export_type", _choice(EXPORT_TYPES), "Export format: text or db."),
    Option("data_simplification", "profile_data_simplification", parse_bool, "Shrink the output (see README)."),
    Option("with_cpu", "profile_with_cpu", parse_bool, "Also collect CPU activity (NPU; always on for torch)."),
    Option("with_stack", "profile_with_stack", parse_bool, "Record Python call stacks."),
    Option("with_memory", "profile_with_memory", parse_bool, "Record memory allocation and release events."),
    Option("record_shapes", "profile_record_shapes", parse_bool, "Record operator input shapes."),
    Option("save_path", "profile_save_path", parse_str, "Directory the captures are written under."),
    Option("warmup_steps", "profile_warmup_steps", parse_int, "Warmup steps before a window (recorded, discarded).",
           ours=True),
    Option("gzip", "profile_gzip", parse_bool, "Write the trace gzipped (.json.gz).", ours=True),
    Option("job_id", "profile_job_id", parse_str, "Job name in metadata and the default trigger dir.", ours=True),
    Option("max_window_steps", "profile_max_window_steps", parse_int,
           "Cap on the length of an on-demand window, in steps.", ours=True),
    Option("ondemand", "profile_ondemand", parse_bool, "Listen for on-demand triggers (files, daemon).", ours=True),
    Option("ondemand_steps", "profile_ondemand_steps", parse_int, "Length of a default on-demand window.", ours=True),
    Option("trigger_dir", "profile_trigger_dir", parse_str, "Directory watched for trigger files.", ours=True),
    Option("trigger_poll_s", "profile_trigger_poll", parse_float,
           "Poll the trigger dir every N s instead of inotify (0 = inotify, polling where it fails).", ours=True),
    Option("signal", "profile_signal", parse_str, "Open the default window on this signal (e.g. SIGUSR2); off when "
           "empty.", ours=True),
    Option("daemon", "profile_daemon", parse_bool, "Register with the host daemon (ondemand-profd) when one runs.",
           ours=True),
    Option("runtime_dir", "profile_runtime_dir", parse_str, "The daemon's runtime directory (default: "
           "/run/ondemand_prof for root, else /tmp/ondemand_prof-<uid>/run).", ours=True),
    Option("export_timeout_s", "profile_export_timeout", parse_float, "How long close() waits for pending exports.",
           ours=True),
    Option("min_free_mb", "profile_min_free_mb", parse_int, "Skip a window when less disk than this is free.",
           ours=True),
)
OPTION_BY_KEY = {o.key: o for o in OPTIONS}
OPTION_BY_FIELD = {o.field: o for o in OPTIONS}


def validate(config: ProfileConfig, labels: Mapping[str, str] | None = None) -> ProfileConfig:
    """Cross-field checks; labels map a field to where its value came from (flag, YAML key, env var)."""
    labels = labels or {}

    def label(name: str) -> str:
        return labels.get(name, OPTION_BY_FIELD[name].flag)

    if config.step_start < 0:
        raise _err(label("step_start"), config.step_start, "a step >= 0")
    if config.step_end != -1 and config.step_end <= config.step_start:
        raise ConfigError(
            f"invalid {label('step_end')} {config.step_end!r}: expected -1 or a step greater than "
            f"{label('step_start')} ({config.step_start})"
        )
    if config.warmup_steps < 0:
        raise _err(label("warmup_steps"), config.warmup_steps, "0 or more steps")
    if config.max_window_steps < 1:
        raise _err(label("max_window_steps"), config.max_window_steps, "1 or more steps")
    if not 1 <= config.ondemand_steps <= config.max_window_steps:
        raise _err(label("ondemand_steps"), config.ondemand_steps, f"1 to {config.max_window_steps} steps")
    if config.trigger_poll_s < 0:
        raise _err(label("trigger_poll_s"), config.trigger_poll_s, "0 (inotify) or a positive interval in seconds")
    if config.export_timeout_s <= 0:
        raise _err(label("export_timeout_s"), config.export_timeout_s, "a positive number of seconds")
    if config.min_free_mb < 0:
        raise _err(label("min_free_mb"), config.min_free_mb, "0 or more MB")
    if not config.save_path:
        raise _err(label("save_path"), config.save_path, "a directory path")
    if config.signal:
        from .signals import parse_signal  # local: keeps this module free of signal handling

        parse_signal(config.signal, label("signal"))
    return config


def _build(values: Mapping[str, tuple[Any, str]], base: ProfileConfig) -> ProfileConfig:
    """values: field -> (raw value, label). Parses each, then validates the whole."""
    parsed = {}
    labels = {}
    for name, (raw, lab) in values.items():
        parsed[name] = OPTION_BY_FIELD[name].parse(raw, lab)
        labels[name] = lab
    env = _env_values(os.environ)
    for name, (raw, lab) in env.items():
        parsed[name] = OPTION_BY_FIELD[name].parse(raw, lab)
        labels[name] = lab
    return validate(base.replace(**parsed), labels)


def _env_values(environ: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    return {o.field: (environ[o.env_var], o.env_var) for o in OPTIONS if o.env_var in environ}


# ----------------------------------------------------------------------------------------------------------
# The three entry points.


def add_profile_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the profiling flags; flags the parser already has (e.g. Megatron's --profile) are left alone."""
    existing = set(parser._option_string_actions)  # noqa: SLF001 - argparse has no public accessor
    group = parser.add_argument_group("profiling (ondemand_prof)")
    for opt in OPTIONS:
        if opt.flag in existing:
            continue
        kwargs: dict[str, Any] = {"dest": opt.key, "help": opt.help + f" Env: {opt.env_var}."}
        if opt.parse is parse_bool:
            if opt.default:
                kwargs["action"] = argparse.BooleanOptionalAction
                kwargs["default"] = None
            else:
                kwargs["action"] = "store_true"
                kwargs["default"] = None
        elif opt.parse is parse_ranks:
            kwargs.update(nargs="+", default=None, metavar="RANK")
        else:
            kwargs.update(default=None, metavar=opt.key.removeprefix("profile_").upper())
        group.add_argument(opt.flag, **kwargs)
    return parser


def config_from_args(args: argparse.Namespace) -> ProfileConfig:
    """Read the flags back from a parsed namespace (ours or a Megatron-style parser's)."""
    values = {}
    for opt in OPTIONS:
        raw = getattr(args, opt.key, None)
        if raw is None:
            continue
        values[opt.field] = (raw, opt.flag)
    return _build(values, ProfileConfig())


def config_from_mapping(data: Mapping[str, Any] | str | os.PathLike[str], *, source: str = "") -> ProfileConfig:
    """From a training YAML (path or dict). Keys are read under ``training:`` when present, else at top level.

    FSDP2 defaults apply (profile_ranks: [-1]). Unknown ``profile_*`` keys are errors, so a typo cannot
    silently disable a window; other keys belong to the training config and are ignored.
    """
    if isinstance(data, (str, os.PathLike)):
        source = str(data)
        data = _load_yaml(data)
    if not isinstance(data, Mapping):
        raise ConfigError(f"invalid configuration {source or ''}: expected a mapping, got {type(data).__name__}")
    section = data.get("training", data)
    prefix = "training." if "training" in data else ""
    if not isinstance(section, Mapping):
        raise ConfigError(f"invalid {prefix or ''}training section: expected a mapping")
    base = ProfileConfig(ranks=OPTION_BY_KEY["profile_ranks"].yaml_default)
    values = {}
    for key, raw in section.items():
        if not isinstance(key, str) or not key.startswith("profile"):
            continue
        opt = OPTION_BY_KEY.get(key)
        if opt is None:
            known = ", ".join(o.key for o in OPTIONS)
            raise ConfigError(f"unknown key {prefix}{key} in {source or 'configuration'}: known keys are {known}")
        if raw is None:
            continue
        values[opt.field] = (raw, f"{prefix}{key}")
    return _build(values, base)


def config_from_env(base: ProfileConfig | None = None) -> ProfileConfig:
    return _build({}, base or ProfileConfig())


def _load_yaml(path: str | os.PathLike[str]) -> Any:
    import yaml

    try:
        with open(path, encoding="utf-8") as fh:
            return yaml.safe_load(fh) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read configuration file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"configuration file {path} is not valid YAML: {exc}") from None


def default_job_id(environ: Mapping[str, str] | None = None) -> str:
    """A job name that is the same on every rank of one job and differs between jobs on one host."""
    environ = os.environ if environ is None else environ
    for var in ("ONDEMAND_PROF_JOB_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "MASTER_PORT"):
        value = environ.get(var)
        if value and value != "none":
            return ("port" + value) if var == "MASTER_PORT" else value
    return f"pid{os.getppid() if environ.get('RANK') else os.getpid()}"


def describe_options() -> list[dict[str, str]]:
    """For the README table and --help-like listings."""
    return [
        {"flag": o.flag, "yaml": o.key, "env": o.env_var, "default": repr(o.default), "help": o.help} for o in OPTIONS
    ]


__all__ = [
    "ConfigError",
    "ProfileConfig",
    "OPTIONS",
    "LEVELS",
    "EXPORT_TYPES",
    "add_profile_args",
    "config_from_args",
    "config_from_mapping",
    "config_from_env",
    "default_job_id",
]
