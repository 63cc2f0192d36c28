"""ProfileConfig and WindowOptions, generated from core/options.py OPTIONS by
`python scripts/generate.py`: edit the table, not this file."""

from __future__ import annotations

from dataclasses import dataclass

from .configbase import ConfigMethods, WindowMethods


@dataclass(frozen=True)
class ProfileConfig(ConfigMethods):
    """Everything the profiler hook needs to know (docs/configuration.md)."""

    enabled: bool = False  # Enable the static profiling window.
    step_start: int = 0  # First step recorded (inclusive).
    step_end: int = -1  # Step at which recording stops (exclusive); -1 = until close().
    # Ranks the static window profiles: a list or ranges like 0 3, 0-3,8; -1 anywhere = all ranks (env: 0,1 or 0-3).
    ranks: tuple[int, ...] = (0,)
    level: str = 'level0'  # Collection level: level_none, level0, level1, level2.
    export_type: str = 'text'  # Export format: text or db.
    data_simplification: bool = False  # Shrink the trace (docs: Levels and output).
    with_cpu: bool = False  # NPU: add ProfilerActivity.CPU (torch: CPU activity is always on).
    with_stack: bool = False  # Record Python call stacks.
    with_memory: bool = False  # Record memory allocation and release events.
    record_shapes: bool = False  # Record operator input shapes.
    save_path: str = './profile'  # Directory the captures are written under.
    warmup_steps: int = 1  # Warmup steps before a window (profiler running, data discarded).
    gzip: bool = False  # Write the trace gzipped (.json.gz).
    job_id: str = ''  # Job name in metadata and the default trigger dir.
    # Cap on the length of an on-demand window, in steps (a request for more is capped and says so).
    max_window_steps: int = 200
    ondemand: bool = True  # Listen for on-demand triggers (files, daemon).
    ondemand_steps: int = 2  # Length of a default on-demand window.
    # Ranks an on-demand request that names none captures (a touched trigger file, a signal, ondemandctl capture
    # without --ranks); -1 = all. --profile-ranks is the static window's.
    ondemand_ranks: tuple[int, ...] = (-1,)
    trigger_dir: str = ''  # Directory watched for trigger files.
    # Poll the trigger dir every N s instead of inotify (0 = inotify, 0.5 s polling on network filesystems or where
    # inotify fails).
    trigger_poll_s: float = 0.0
    signal: str = ''  # Open the default window on this signal (e.g. SIGUSR2); off when empty.
    # Register with the host daemon (ondemand-profd) when one runs (nothing happens when none does).
    daemon: bool = True
    runtime_dir: str = ''  # The daemon's runtime directory, where its socket is.
    export_timeout_s: float = 120.0  # How long close() waits for pending exports (s).
    min_free_mb: int = 256  # Skip a window (with a log line) when less disk than this is free (MB).
    # Mode of the files a capture writes, in octal; its directories get the matching search bits (0640 -> 0750).
    file_mode: int = 0o640
    # Capture on its own when the step time shifts to this many times the baseline's (e.g. 1.5; 0 = off): a CUSUM on
    # log step times against the baseline's steps.
    auto_ratio: float = 0.0
    auto_steps: int = 3  # Slow steps at least behind an automatic capture (of those that raised the CUSUM).
    # With --profile-auto: the number of steps of an unchanged job per false alarm at most: the CUSUM's threshold is
    # ln of it.
    auto_false_alarm_steps: int = 1000000
    # With --profile-auto: seconds a shift must last (the CUSUM over its threshold, never back to 0) before it opens
    # a capture: a burst of the host's load is not a slowdown.
    auto_confirm_s: float = 10.0
    # Seconds after an automatic capture during which no other starts, unless the steps are back to the baseline's
    # meanwhile.
    auto_cooldown_s: float = 600.0
    auto_per_hour: int = 4  # Automatic captures per hour at most.
    # With --profile-auto: the step of the one baseline window automatic captures are compared with (0: once step
    # times are steady after warm-up; -1: none).
    auto_baseline_at: int = 0
    # No start-up line and no 'capture written' lines on stderr (they still go to the ondemand_prof logger).
    quiet: bool = False


@dataclass(frozen=True)
class WindowOptions(WindowMethods):
    """The profiler options one window records with: the window options of OPTIONS."""

    level: str = 'level0'  # Collection level: level_none, level0, level1, level2.
    export_type: str = 'text'  # Export format: text or db.
    data_simplification: bool = False  # Shrink the trace (docs: Levels and output).
    with_cpu: bool = False  # NPU: add ProfilerActivity.CPU (torch: CPU activity is always on).
    with_stack: bool = False  # Record Python call stacks.
    with_memory: bool = False  # Record memory allocation and release events.
    record_shapes: bool = False  # Record operator input shapes.
