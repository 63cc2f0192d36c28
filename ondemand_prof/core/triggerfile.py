"""Where a job's trigger file lives and how a version of it is named: shared by the rank (rank/triggers.py, which
watches it) and ondemandctl trigger (host/commands/trigger.py, which writes it and reads what each rank did).

    {trigger dir}/capture                       what the user touches or writes JSON into
    {trigger dir}/capture.status/rank{R}.json   what rank R did with the latest triggers (each named by version)
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from .files import path_component

TRIGGER_NAME = "capture"
STATUS_DIR = TRIGGER_NAME + ".status"
TRIGGER_DIR_ENV = "ONDEMAND_PROF_TRIGGER_DIR"  # --profile-trigger-dir's variable (core/options.py)


def job_dir_name(job_id: str) -> str:
    """A job id as one path component (files.path_component): no separators, never '.' or '..', bounded."""
    return path_component(job_id, "job")


def default_trigger_dir(job_id: str) -> Path:
    """Per user and per job, so two jobs on one host never share a trigger (torch_npu's shm collision)."""
    return Path(tempfile.gettempdir()) / f"ondemand_prof-{os.getuid()}" / job_dir_name(job_id)


def version_base(st: os.stat_result) -> str:
    """What a writer changes (time of modification, inode, size), never the inode change time alone: a chmod, a
    hard link or `touch -a` of a handled trigger must not replay it."""
    return f"{st.st_mtime_ns}:{st.st_ino}:{st.st_size}"


def trigger_version(st: os.stat_result, raw: bytes | None) -> str:
    """The name of one version of the trigger file: its stat (version_base) and, once read, its bytes. The rank
    names each trigger so in its status file; ondemandctl trigger computes it for the file it wrote."""
    base = version_base(st).encode()
    return hashlib.sha1(base if raw is None else base + b"\0" + raw).hexdigest()[:16]
