"""Every profiler option, declared once, and everything derived from that one table.

Each Option says its name, type, default, flag, YAML key, env var, whether a window request may set it, and what
each backend does with it. From OPTIONS come: ProfileConfig (the job's configuration), WindowOptions (what one
window records with), the argparse flags of the training script (add_profile_args) and of `ondemandctl capture`
(add_window_flags), YAML and env parsing, and the request checks (core/requests.py). Adding an option is one
entry here plus, for a window option, its backend mapping string. Names and defaults of the first twelve follow
MindSpeed LLM (MCore flags, FSDP2 YAML keys). Pure: no I/O besides reading a YAML file when given a path.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import logging
import math
import os
import signal as _signal
import textwrap
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from .bounds import MAX_STEP
from .configbase import ConfigMethods, WindowMethods
from .ids import MAX_ID, safe_id, valid_id
from .ranks import RankSpecError, parse_ranks

log = logging.getLogger(__name__)

LEVELS = ("level_none", "level0", "level1", "level2")
EXPORT_TYPES = ("text", "db")
ENV_PREFIX = "ONDEMAND_PROF_"
# environment variables of ours that are not profiler options (the daemon's, the CLI's, the tests')
OTHER_ENV = {"ONDEMAND_PROF_STATE_DIR", "ONDEMAND_PROF_LOG", "ONDEMAND_PROF_FORK_SAVE", "ONDEMAND_PROF_AUTO",
             "ONDEMAND_PROF_AUTO_NO_STEP_S", "ONDEMAND_PROF_EXPORT_SCHED", "ONDEMAND_PROF_TRACE_SAVE",
             "ONDEMAND_PROF_HELPER_CPUS", "ONDEMAND_PROF_SUMMARY_DEFER_S"}
# signals a training job relies on for its own life; we refuse to take them over
RESERVED_SIGNALS = {"SIGINT", "SIGTERM", "SIGKILL", "SIGSTOP", "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT",
                    "SIGCHLD", "SIGPIPE"}


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the flag/key, the value and what is accepted."""


# ----------------------------------------------------------------------------------------------------------
# Value parsers. Each takes the raw value (a string from argv/env, or a YAML scalar/list) and the label of where
# it came from, and returns the typed value or raises ConfigError. `strict` (requests: JSON values) refuses
# the string forms that flags and env vars need ("1", "true").


def _err(label: str, value: Any, accepted: str) -> ConfigError:
    return ConfigError(f"invalid {label} {value!r}: expected {accepted}")


def parse_bool(value: Any, label: str, strict: bool = False) -> bool:
    if isinstance(value, bool):
        return value
    if not strict:
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        text = value.strip().lower() if isinstance(value, str) else None
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off", ""):
            return False
    raise _err(label, value, "true or false")


def parse_int(value: Any, label: str, strict: bool = False) -> int:
    if isinstance(value, bool):
        raise _err(label, value, "an integer")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer() and abs(value) <= MAX_STEP:
        return int(value)
    if isinstance(value, str) and not strict:
        text = value.strip()
        digits = text.lstrip("+-")
        if digits.isascii() and digits.isdigit() and len(text) <= 19:  # ('¹'.isdigit() is true; int() refuses it)
            return int(text)
    raise _err(label, value, "an integer")


def parse_float(value: Any, label: str, strict: bool = False) -> float:
    if isinstance(value, bool):
        raise _err(label, value, "a number")
    number: float | None = None
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str) and not strict:
        try:
            number = float(value.strip())
        except ValueError:
            pass
    if number is None or not math.isfinite(number):
        raise _err(label, value, "a finite number")
    return number


def parse_rank_list(value: Any, label: str, strict: bool = False) -> tuple[int, ...]:
    """The one rank grammar (core/ranks.py): 3, "0-3,7", "0 1", [0, "2-3"]; -1 anywhere means all ranks."""
    try:
        return parse_ranks(value)
    except RankSpecError as exc:
        raise ConfigError(f"invalid {label} {value!r}: {exc}") from None


def parse_str(value: Any, label: str, strict: bool = False) -> str:
    if value is None:
        return ""
    if not isinstance(value, (str, int, float)) or isinstance(value, bool) or (strict and not isinstance(value, str)):
        raise _err(label, value, "a string")
    return str(value)


def parse_job_id(value: Any, label: str, strict: bool = False) -> str:
    """A job id: what the daemon and `ondemandctl --job` take (core/ids.py's rule), or "" for the default."""
    text = parse_str(value, label, strict)
    if text and not valid_id(text):
        raise _err(label, value, f"1-{MAX_ID} letters, digits, '_', '.', '-', '+', '@' or ':', not starting with "
                                 "'.' or '-'")
    return text


def parse_signal(value: Any, label: str = "--profile-signal", strict: bool = False) -> str:
    """A signal name ('SIGUSR2', 'usr2', '12'); '' is off. Reserved signals are refused."""
    text = parse_str(value, label, strict).strip().upper()
    if not text:
        return ""
    sig: _signal.Signals | None
    if text.isdigit():
        try:
            sig = _signal.Signals(int(text))
        except ValueError:
            raise ConfigError(f"invalid {label} {value!r}: expected a signal name such as SIGUSR2") from None
    else:
        sig = getattr(_signal.Signals, text if text.startswith("SIG") else "SIG" + text, None)
        if sig is None:
            raise ConfigError(f"invalid {label} {value!r}: expected a signal name such as SIGUSR2 or SIGUSR1")
    if sig.name in RESERVED_SIGNALS:
        raise ConfigError(f"invalid {label} {value!r}: {sig.name} is reserved; use SIGUSR1, SIGUSR2 or a "
                          "SIGRTMIN+n")
    return sig.name


def parse_mode(value: Any, label: str, strict: bool = False) -> int:
    """A file mode: octal text ("0640", "640", "0o640"), or an int (YAML reads 0640 as octal; a decimal 640 is
    read as the octal it spells)."""
    if isinstance(value, int) and not isinstance(value, bool):
        text = str(value)
        if value <= 0o777:
            return value
        value = text
    text = str(value).strip().lower().removeprefix("0o")
    if not text or len(text) > 4 or any(c not in "01234567" for c in text) or int(text, 8) > 0o777:
        raise _err(label, value, "an octal file mode such as 0640")
    return int(text, 8)


# what each parser returns, as the generated ProfileConfig annotates it (core/config.py)
for _parse, _type in ((parse_bool, "bool"), (parse_int, "int"), (parse_float, "float"),
                      (parse_rank_list, "tuple[int, ...]"), (parse_str, "str"), (parse_job_id, "str"),
                      (parse_signal, "str"), (parse_mode, "int")):
    _parse.type_name = _type  # type: ignore[union-attr]  # a function attribute on purpose: Option.type_name reads it


def choice(choices: Sequence[str]) -> Callable[..., str]:
    def parse(value: Any, label: str, strict: bool = False) -> str:
        text = value.strip().lower() if isinstance(value, str) and not strict else value
        if text not in choices:
            raise _err(label, value, "one of " + ", ".join(choices))
        return text

    parse.choices = tuple(choices)  # type: ignore[attr-defined]
    parse.type_name = "str"  # type: ignore[attr-defined]
    return parse


# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Option:
    """One profiler option.

    torch / npu: what the backend does with a window option. "kwarg:NAME" turns on that keyword of
    torch.profiler.profile / torch_npu.profiler.profile (or-ed with what the level turns on); "experimental:NAME"
    sets that field of torch_npu's _ExperimentalConfig; "activity:CPU" adds the CPU activity; "level" is the
    level table (docs/levels-and-output.md); "postprocess" is done by our post-processing child; "always" means the
    backend always does it. bounds: (lo, hi) for numbers, inclusive.
    """

    name: str  # ProfileConfig attribute
    key: str  # YAML key under training:, also the argparse dest (Megatron's names)
    parse: Callable[..., Any]
    default: Any
    help: str
    env: str = ""  # ONDEMAND_PROF_<env>; derived from key when empty
    yaml_default: Any = None  # FSDP2 YAML default when it differs from the MCore default
    ours: bool = False  # not a MindSpeed option
    window: bool = False  # a window request (trigger file, ondemandctl capture) may set it
    torch: str = ""
    npu: str = ""
    bounds: tuple[float, float] | None = None
    negatable: bool = False  # the flag has a --no- form (bools that default to on)
    default_doc: str = ""  # the default as the reference shows it, where the value alone does not say it

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    @property
    def env_var(self) -> str:
        return ENV_PREFIX + (self.env or self.key.removeprefix("profile_").upper())

    @property
    def choices(self) -> tuple[str, ...] | None:
        return getattr(self.parse, "choices", None)

    @property
    def type_name(self) -> str:
        return getattr(self.parse, "type_name", "Any")

    def value(self, raw: Any, label: str, strict: bool = False) -> Any:
        """Parse and bound one value; ConfigError names `label`."""
        parsed = self.parse(raw, label, strict)
        if self.bounds is not None and not self.bounds[0] <= parsed <= self.bounds[1]:
            lo, hi = self.bounds
            accepted = f"{lo:g} or more" if hi >= MAX_STEP else f"{lo:g} to {hi:g}"
            raise ConfigError(f"invalid {label} {raw!r}: expected {accepted}")
        return parsed


_B = parse_bool
OPTIONS: tuple[Option, ...] = (
    Option("enabled", "profile", _B, False, "Enable the static profiling window.", env="ENABLE"),
    Option("step_start", "profile_step_start", parse_int, 0, "First step recorded (inclusive).",
           bounds=(0, MAX_STEP)),
    Option("step_end", "profile_step_end", parse_int, -1,
           "Step at which recording stops (exclusive); -1 = until close().", bounds=(-1, MAX_STEP)),
    Option("ranks", "profile_ranks", parse_rank_list, (0,),
           "Ranks the static window profiles: a list or ranges like 0 3, 0-3,8; -1 anywhere = all ranks (env: "
           "0,1 or 0-3).",
           yaml_default=(-1,)),
    Option("level", "profile_level", choice(LEVELS), "level0", "Collection level: " + ", ".join(LEVELS) + ".",
           window=True, torch="level", npu="experimental:profiler_level"),
    Option("export_type", "profile_export_type", choice(EXPORT_TYPES), "text", "Export format: text or db.",
           window=True, torch="postprocess", npu="experimental:export_type"),
    Option("data_simplification", "profile_data_simplification", _B, False,
           "Shrink the trace (docs: Levels and output).", window=True, torch="postprocess",
           npu="experimental:data_simplification"),
    Option("with_cpu", "profile_with_cpu", _B, False, "NPU: add ProfilerActivity.CPU (torch: CPU activity is always "
           "on).", window=True, torch="always", npu="activity:CPU"),
    Option("with_stack", "profile_with_stack", _B, False, "Record Python call stacks.",
           window=True, torch="kwarg:with_stack", npu="kwarg:with_stack"),
    Option("with_memory", "profile_with_memory", _B, False, "Record memory allocation and release events.",
           window=True, torch="kwarg:profile_memory", npu="kwarg:profile_memory"),
    Option("record_shapes", "profile_record_shapes", _B, False, "Record operator input shapes.",
           window=True, torch="kwarg:record_shapes", npu="kwarg:record_shapes"),
    Option("save_path", "profile_save_path", parse_str, "./profile", "Directory the captures are written under."),
    Option("warmup_steps", "profile_warmup_steps", parse_int, 1,
           "Warmup steps before a window (profiler running, data discarded).", ours=True, bounds=(0, 100)),
    Option("gzip", "profile_gzip", _B, False, "Write the trace gzipped (.json.gz).", ours=True),
    Option("job_id", "profile_job_id", parse_job_id, "", "Job name in metadata and the default trigger dir.",
           ours=True, default_doc="from `SLURM_JOB_ID` (`JOBID.STEPID` with `SLURM_STEP_ID`), `TORCHELASTIC_RUN_ID` "
           "(torchrun, `accelerate launch`), `MASTER_PORT` (Lightning's and Accelerate's own launchers, `mp.spawn` "
           "scripts), else the launcher's pid; once torch.distributed is up, rank 0's id for every rank"),
    Option("max_window_steps", "profile_max_window_steps", parse_int, 200,
           "Cap on the length of an on-demand window, in steps (a request for more is capped and says so).", ours=True,
           bounds=(1, 1_000_000)),
    Option("ondemand", "profile_ondemand", _B, True, "Listen for on-demand triggers (files, daemon).", ours=True,
           negatable=True),
    Option("ondemand_steps", "profile_ondemand_steps", parse_int, 2, "Length of a default on-demand window.",
           ours=True, bounds=(1, 1_000_000)),
    Option("ondemand_ranks", "profile_ondemand_ranks", parse_rank_list, (-1,),
           "Ranks an on-demand request that names none captures (a touched trigger file, a signal, ondemandctl "
           "capture without --ranks); -1 = all. --profile-ranks is the static window's.", ours=True),
    Option("trigger_dir", "profile_trigger_dir", parse_str, "", "Directory watched for trigger files.", ours=True,
           default_doc="`$TMPDIR/ondemand_prof-<uid>/<job id>`"),
    Option("trigger_poll_s", "profile_trigger_poll", parse_float, 0.0,
           "Poll the trigger dir every N s instead of inotify (0 = inotify, 0.5 s polling on network filesystems or "
           "where inotify fails).", ours=True,
           bounds=(0, 3600)),
    Option("signal", "profile_signal", parse_signal, "",
           "Open the default window on this signal (e.g. SIGUSR2); off when empty.", ours=True),
    Option("daemon", "profile_daemon", _B, True,
           "Register with the host daemon (ondemand-profd) when one runs (nothing happens when none does).",
           ours=True, negatable=True),
    Option("runtime_dir", "profile_runtime_dir", parse_str, "", "The daemon's runtime directory, where its "
           "socket is.", ours=True, default_doc="`/run/ondemand_prof` for root, else "
           "`/tmp/ondemand_prof-<uid>/run`"),
    Option("export_timeout_s", "profile_export_timeout", parse_float, 120.0,
           "How long close() waits for pending exports (s).", ours=True, bounds=(0.001, 86400)),
    Option("min_free_mb", "profile_min_free_mb", parse_int, 256,
           "Skip a window (with a log line) when less disk than this is free (MB).", ours=True, bounds=(0, MAX_STEP)),
    Option("file_mode", "profile_file_mode", parse_mode, 0o640, "Mode of the files a capture writes, in octal; "
           "its directories get the matching search bits (0640 -> 0750).", ours=True),
    # captures on condition (rank/autocapture.py); env AUTO_RATIO: ONDEMAND_PROF_AUTO is the zero-code switch
    Option("auto_ratio", "profile_auto", parse_float, 0.0, "Capture on its own when the step time shifts to this "
           "many times the baseline's (e.g. 1.5; 0 = off): a CUSUM on log step times against the baseline's steps.",
           env="AUTO_RATIO", ours=True, bounds=(0, 1000)),
    Option("auto_steps", "profile_auto_steps", parse_int, 3, "Slow steps at least behind an automatic capture (of "
           "those that raised the CUSUM).", ours=True, bounds=(1, 10_000)),
    Option("auto_false_alarm_steps", "profile_auto_false_alarm", parse_int, 1_000_000, "With --profile-auto: the "
           "number of steps of an unchanged job per false alarm at most: the CUSUM's threshold is ln of it.", ours=True,
           bounds=(100, 10**12)),
    Option("auto_confirm_s", "profile_auto_confirm", parse_float, 10.0, "With --profile-auto: seconds a shift must "
           "last (the CUSUM over its threshold, never back to 0) before it opens a capture: a burst of the host's "
           "load is not a slowdown.", ours=True, bounds=(0, 3600)),
    Option("auto_cooldown_s", "profile_auto_cooldown", parse_float, 600.0, "Seconds after an automatic capture "
           "during which no other starts, unless the steps are back to the baseline's meanwhile.", ours=True,
           bounds=(0, 86400 * 7)),
    Option("auto_per_hour", "profile_auto_budget", parse_int, 4, "Automatic captures per hour at most.", ours=True,
           bounds=(1, 3600)),
    Option("auto_baseline_at", "profile_baseline_at", parse_int, 0, "With --profile-auto: the step of the one "
           "baseline window automatic captures are compared with (0: once step times are steady after warm-up; "
           "-1: none).", ours=True, bounds=(-1, MAX_STEP)),
    Option("quiet", "profile_quiet", _B, False, "No start-up line and no 'capture written' lines on stderr "
           "(they still go to the ondemand_prof logger).", ours=True),
)


def window_options(options: Sequence[Option] = OPTIONS) -> tuple[Option, ...]:
    return tuple(o for o in options if o.window)


def make_config_class(options: Sequence[Option] = OPTIONS) -> type:
    """A ProfileConfig for another table (tests, extensions): a frozen dataclass with one field per option.
    The package's own ProfileConfig is generated from OPTIONS into core/config.py, so editors and type checkers
    see its fields and types."""
    fields = [(o.name, o.type_name, dataclasses.field(default=o.default)) for o in options]
    cls = dataclasses.make_dataclass("ProfileConfig", fields, bases=(ConfigMethods,), frozen=True)
    cls.__module__ = __name__
    return cls


def make_window_options_class(options: Sequence[Option] = OPTIONS) -> type:
    """WindowOptions for another table: the window options of the table; a request may override any of them."""
    fields = [(o.name, o.type_name, dataclasses.field(default=o.default)) for o in window_options(options)]
    cls = dataclasses.make_dataclass("WindowOptions", fields, bases=(WindowMethods,), frozen=True)
    cls.__module__ = __name__
    return cls


def _literal(option: Option) -> str:
    return oct(option.default) if option.parse is parse_mode else repr(option.default)


def render_config_module(options: Sequence[Option] = OPTIONS) -> str:
    """The text of core/config.py: ProfileConfig and WindowOptions written out from the table (a test checks
    that the file is this text; `python scripts/generate.py` rewrites it)."""
    def field(o: Option) -> str:
        line = f"    {o.name}: {o.type_name} = {_literal(o)}"
        if len(line) + len(o.help) + 4 <= 116:
            return f"{line}  # {o.help}\n"
        return "".join(f"    # {text}\n" for text in textwrap.wrap(o.help, 110)) + line + "\n"

    def fields(opts: Sequence[Option]) -> str:
        return "".join(field(o) for o in opts)

    return ('"""ProfileConfig and WindowOptions, generated from core/options.py OPTIONS by\n'
            '`python scripts/generate.py`: edit the table, not this file."""\n\n'
            "from __future__ import annotations\n\n"
            "from dataclasses import dataclass\n\n"
            "from .configbase import ConfigMethods, WindowMethods\n\n\n"
            "@dataclass(frozen=True)\n"
            "class ProfileConfig(ConfigMethods):\n"
            '    """Everything the profiler hook needs to know (docs/configuration.md)."""\n\n'
            f"{fields(options)}\n\n"
            "@dataclass(frozen=True)\n"
            "class WindowOptions(WindowMethods):\n"
            '    """The profiler options one window records with: the window options of OPTIONS."""\n\n'
            f"{fields(window_options(options))}")


def _default_text(option: Option) -> str:
    """How the reference shows a default: as a user writes it."""
    if option.default_doc:
        return option.default_doc
    value = option.default
    if isinstance(value, tuple):
        text = f"`{list(value)}`" if value != (-1,) else "`-1` (all)"
    elif option.parse is parse_mode:
        text = f"`{value:04o}`"
    elif value == "":
        text = "off"
    else:
        text = f"`{value}`"
    if option.yaml_default is not None:
        text += f" (YAML `{list(option.yaml_default)}`)"
    return text


def render_config_reference(options: Sequence[Option] = OPTIONS) -> str:
    """The configuration reference (docs/configuration-reference.md), one row per option of the table."""
    rows = ["| flag | YAML key | env | default | meaning |", "|---|---|---|---|---|"]
    for o in options:
        flag = f"`{o.flag}` / `--no-{o.flag[2:]}`" if o.negatable else f"`{o.flag}`"
        where = " Window option: a trigger file or `ondemandctl capture` may set it." if o.window else ""
        rows.append(f"| {flag} | `{o.key}` | `{o.env_var}` | {_default_text(o)} | {o.help}{where} |")
    return ("<!-- generated from ondemand_prof/core/options.py OPTIONS by `python scripts/generate.py`: edit the "
            "table, not this file -->\n\n" + "\n".join(rows) + "\n")


from .config import ProfileConfig, WindowOptions  # noqa: E402 - generated from OPTIONS above
OPTION_BY_KEY = {o.key: o for o in OPTIONS}
OPTION_BY_NAME = {o.name: o for o in OPTIONS}


# ----------------------------------------------------------------------------------------------------------
# Cross-field checks and building a config from labelled raw values


def validate(config: Any, labels: Mapping[str, str] | None = None) -> Any:
    """Cross-field checks; labels map a field to where its value came from (flag, YAML key, env var)."""
    labels = labels or {}

    def label(name: str) -> str:
        return labels.get(name, OPTION_BY_NAME[name].flag)

    if config.step_end != -1 and config.step_end <= config.step_start:
        raise ConfigError(
            f"invalid {label('step_end')} {config.step_end!r}: expected -1 or a step greater than "
            f"{label('step_start')} ({config.step_start})"
        )
    if not 1 <= config.ondemand_steps <= config.max_window_steps:
        raise _err(label("ondemand_steps"), config.ondemand_steps, f"1 to {config.max_window_steps} steps")
    if 0 < config.auto_ratio <= 1:
        raise _err(label("auto_ratio"), config.auto_ratio, "0 (off) or a ratio above 1, such as 1.5")
    if not config.save_path:
        raise _err(label("save_path"), config.save_path, "a directory path")
    return config


def _build(values: Mapping[str, tuple[Any, str]], base: Any, environ: Mapping[str, str] | None = None,
           options: Sequence[Option] = OPTIONS) -> Any:
    """values: name -> (raw value, label). The environment overrides them. Parses each, then validates."""
    environ = os.environ if environ is None else environ
    by_name = {o.name: o for o in options}
    merged = dict(values)
    merged.update({o.name: (environ[o.env_var], o.env_var) for o in options if o.env_var in environ})
    warn_unknown_env(environ, options)
    parsed = {name: by_name[name].value(raw, lab) for name, (raw, lab) in merged.items()}
    return validate(base.replace(**parsed), {name: lab for name, (_, lab) in merged.items()})


_warned_env: set[str] = set()


def warn_unknown_env(environ: Mapping[str, str], options: Sequence[Option] = OPTIONS) -> list[str]:
    """An ONDEMAND_PROF_* variable we do not know is probably a typo: say so once, naming the closest one."""
    known = {o.env_var for o in options} | OTHER_ENV
    unknown = sorted(k for k in environ if k.startswith(ENV_PREFIX) and k not in known)
    for name in unknown:
        if name not in _warned_env:
            _warned_env.add(name)
            close = difflib.get_close_matches(name, sorted(known), n=1)
            log.warning("ondemand_prof: unknown environment variable %s ignored%s", name,
                        f" (did you mean {close[0]}?)" if close else "")
    return unknown


# ----------------------------------------------------------------------------------------------------------
# The entry points: flags, YAML/dict, environment


def _arg_type(opt: Option) -> Callable[[str], Any]:
    """argparse type= for a flag: argparse itself reports a bad value as one 'error:' line and exit 2."""

    def convert(text: str) -> Any:
        try:
            return opt.value(text, opt.flag)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc).replace(f"invalid {opt.flag} ", "invalid value ", 1)) from None

    convert.__name__ = opt.name
    return convert


def add_profile_args(parser: argparse.ArgumentParser, options: Sequence[Option] = OPTIONS
                     ) -> argparse.ArgumentParser:
    """Add the profiling flags; flags the parser already has (e.g. Megatron's --profile) are left alone."""
    existing = set(parser._option_string_actions)  # noqa: SLF001 - argparse has no public accessor
    group = parser.add_argument_group("profiling (ondemand_prof)")
    for opt in options:
        if opt.flag in existing:
            continue
        kwargs: dict[str, Any] = {"dest": opt.key, "default": None, "help": f"{opt.help} Env: {opt.env_var}."}
        if opt.parse is parse_bool:
            kwargs["action"] = argparse.BooleanOptionalAction if opt.negatable else "store_true"
        elif opt.parse is parse_rank_list:
            # nargs: MindSpeed writes "--profile-ranks 0 3"; each item may also be a range ("0-3,8")
            kwargs.update(nargs="+", metavar="RANKS")
        else:
            kwargs.update(type=_arg_type(opt), metavar=opt.key.removeprefix("profile_").upper())
        group.add_argument(opt.flag, **kwargs)
    return parser


def config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> Any:
    """Read the flags back from a parsed namespace (ours or a Megatron-style parser's).

    With `parser`, a bad value (e.g. a rank list, or step_end <= step_start) is reported through
    parser.error(): one 'error:' line and exit 2, like any argparse program."""
    values = {o.name: (getattr(args, o.key), o.flag) for o in OPTIONS if getattr(args, o.key, None) is not None}
    try:
        return _build(values, ProfileConfig())
    except ConfigError as exc:
        if parser is None:
            raise
        parser.error(str(exc))


def config_from_mapping(data: Mapping[str, Any] | str | os.PathLike[str], *, source: str = "") -> Any:
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
    base = ProfileConfig(**{o.name: o.yaml_default for o in OPTIONS if o.yaml_default is not None})
    values = {}
    for key, raw in section.items():
        if not isinstance(key, str) or not key.startswith("profile"):
            continue
        opt = OPTION_BY_KEY.get(key)
        if opt is None:
            close = difflib.get_close_matches(key, list(OPTION_BY_KEY), n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
            raise ConfigError(f"unknown key {prefix}{key} in {source or 'configuration'}{hint}; known keys are "
                              + ", ".join(OPTION_BY_KEY))
        if raw is not None:
            values[opt.name] = (raw, f"{prefix}{key}")
    return _build(values, base)


def config_from_env(base: Any = None) -> Any:
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


def add_window_flags(parser: argparse.ArgumentParser, options: Sequence[Option] = OPTIONS) -> None:
    """The window options as `ondemandctl capture` flags: --level, --[no-]with-stack, ... (unset: the rank's
    configuration decides)."""
    for opt in window_options(options):
        flag = "--" + opt.name.replace("_", "-")
        if opt.parse is parse_bool:
            parser.add_argument(flag, dest=opt.name, action=argparse.BooleanOptionalAction, default=None,
                                help=f"{opt.help} (default: the rank's configuration)")
        else:
            parser.add_argument(flag, dest=opt.name, choices=opt.choices, default=None,
                                help=f"{opt.help} (default: the rank's configuration)")  # kept as given (str)


def window_overrides(args: argparse.Namespace, options: Sequence[Option] = OPTIONS) -> dict[str, Any]:
    return {o.name: getattr(args, o.name) for o in window_options(options) if getattr(args, o.name, None) is not None}


def default_job_id(environ: Mapping[str, str] | None = None) -> str:
    """A job name that is the same on every rank of one job and differs between jobs on one host, in one pod, and
    on other nodes (`ondemandctl --hosts` merges jobs by name).

    From the launcher: ONDEMAND_PROF_JOB_ID, a SLURM job (and step: two `srun`s of one allocation are two
    jobs), torchrun's run id (also what `accelerate launch` runs under). Then MASTER_PORT, where a distributed
    launch set it (a WORLD_SIZE over 1, or torchrun's agent): `port29500@ADDR` with a master address
    other ranks reach (Kubernetes' PyTorchJob: the master's service name, the same in every pod of the job), or
    `port29500@HERE` with a loopback one (the port names a job only in its own network namespace: every pod
    has a 29500). Else a pid, named where it lives: the launcher's when RANK says we are one of its workers, our
    own otherwise (`pid4242@HERE`: a pod's pid 1 is every pod's). HERE: this host's name (a pod's own, under
    Kubernetes its pod name), and in a pid namespace of its own (a container), that namespace's number too.
    Once torch.distributed is up, the hook agrees the id through the process group's store (rank 0's wins), so a
    rank that had to guess converges. Ids stay the same across restarts of torchrun's workers.
    """
    environ = os.environ if environ is None else environ
    explicit = environ.get("ONDEMAND_PROF_JOB_ID")
    if explicit:
        return safe_id(explicit)  # (a bad one is refused where the configuration is read; this is a fallback)
    slurm = environ.get("SLURM_JOB_ID")
    if slurm:
        step = environ.get("SLURM_STEP_ID")
        return f"{slurm}.{step}" if step else slurm  # SLURM's own name for a step: JOBID.STEPID
    run_id = environ.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":
        return safe_id(run_id)  # torchrun's --rdzv-id is free text
    try:
        world = int(environ.get("WORLD_SIZE", "0"))
    except ValueError:
        world = 0
    # torchrun's workers (its agent holds the store on MASTER_PORT, whatever the world size), or ranks of a launch
    # of more than one (Lightning's launcher sets WORLD_SIZE before RANK): MASTER_PORT alone (accelerate's single
    # process, a script that sets it) names nothing
    distributed = bool(run_id) or world > 1
    port = environ.get("MASTER_PORT")
    if port and distributed:
        addr = environ.get("MASTER_ADDR", "")
        where = safe_id(addr)[:64] if addr and not _loopback(addr) else local_scope()
        return safe_id(f"port{port}@{where}")
    pid = os.getppid() if distributed and environ.get("RANK") else os.getpid()
    return safe_id(f"pid{pid}@{local_scope()}")


PID_NS_INIT_INO = 0xEFFFFFFC  # the initial pid namespace's inode number (Linux, fixed since 3.8)


def local_scope() -> str:
    """Where this process is, as a job id part: the host name (a pod's own), and where the process lives in a pid
    namespace of its own (a container), that namespace's number, as its pids mean something only there."""
    import socket

    host = safe_id(socket.gethostname() or "localhost")[:48]
    try:
        ino = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return host
    if ino == PID_NS_INIT_INO:
        return host
    return f"{host}.ns{ino - 0xF0000000 if ino > 0xF0000000 else ino}"  # (dynamic ones count up from 0xF0000000)


def _loopback(addr: str) -> bool:
    return addr in ("localhost", "::1", "0.0.0.0", "::", "ip6-localhost") or addr.startswith("127.") or \
        addr.startswith("localhost.")


__all__ = [
    "ConfigError", "ProfileConfig", "WindowOptions", "Option", "OPTIONS", "LEVELS", "EXPORT_TYPES",
    "add_profile_args", "add_window_flags", "config_from_args", "config_from_mapping", "config_from_env",
    "default_job_id", "window_options", "window_overrides",
]

