"""Configuration: MindSpeed's flags and YAML keys, our additions, the environment, and bad values."""

from __future__ import annotations

import argparse
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import run_ranks
from ondemand_prof import ConfigError, OnDemandProfiler, ProfileConfig, add_profile_args, config_from_args, \
    config_from_mapping
from ondemand_prof.core.options import config_from_env

pytestmark = pytest.mark.quick  # in-process: the quick tier (conftest.py)


def parse(*argv: str) -> ProfileConfig:
    parser = add_profile_args(argparse.ArgumentParser())
    return config_from_args(parser.parse_args(list(argv)))


def test_flag_defaults_are_the_seeds():
    cfg = parse()
    assert (cfg.enabled, cfg.step_start, cfg.step_end, cfg.ranks) == (False, 0, -1, (0,))
    assert (cfg.level, cfg.export_type, cfg.save_path) == ("level0", "text", "./profile")
    assert not any([cfg.data_simplification, cfg.with_cpu, cfg.with_stack, cfg.with_memory, cfg.record_shapes])


def test_all_twelve_flags():
    cfg = parse("--profile", "--profile-step-start", "5", "--profile-step-end", "6", "--profile-ranks", "0", "3",
                "--profile-level", "level1", "--profile-export-type", "db", "--profile-data-simplification",
                "--profile-with-cpu", "--profile-with-stack", "--profile-with-memory", "--profile-record-shapes",
                "--profile-save-path", "/tmp/x")
    assert cfg == ProfileConfig(enabled=True, step_start=5, step_end=6, ranks=(0, 3), level="level1",
                                export_type="db", data_simplification=True, with_cpu=True, with_stack=True,
                                with_memory=True, record_shapes=True, save_path="/tmp/x")


def test_megatron_parser_keeps_its_own_flags():
    parser = argparse.ArgumentParser()
    # Megatron-LM defines these four itself
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--profile-step-start", type=int, default=10)
    parser.add_argument("--profile-step-end", type=int, default=12)
    parser.add_argument("--profile-ranks", nargs="+", type=int, default=[0])
    add_profile_args(parser)  # must not raise "conflicting option string"
    args = parser.parse_args(["--profile", "--profile-ranks", "1", "2", "--profile-level", "level2"])
    cfg = config_from_args(args)
    assert (cfg.enabled, cfg.step_start, cfg.step_end, cfg.ranks, cfg.level) == (True, 10, 12, (1, 2), "level2")


def test_yaml_defaults_and_level_none(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("training:\n  profile: true\n  profile_level: level_none\n  micro_batch_size: 4\n")
    cfg = config_from_mapping(path)
    assert cfg.ranks == (-1,) and cfg.level == "level_none" and cfg.enabled
    assert config_from_mapping({"profile_step_start": 2, "profile_step_end": 3}).step_start == 2


def test_minus_one_anywhere_selects_all():
    cfg = parse("--profile-ranks", "-1", "0")
    assert cfg.selects_rank(0) and cfg.selects_rank(7)
    assert not parse("--profile-ranks", "0", "2").selects_rank(1)


def test_environment_overrides(monkeypatch):
    monkeypatch.setenv("ONDEMAND_PROF_ENABLE", "1")
    monkeypatch.setenv("ONDEMAND_PROF_STEP_START", "7")
    monkeypatch.setenv("ONDEMAND_PROF_RANKS", "0,2")
    monkeypatch.setenv("ONDEMAND_PROF_LEVEL", "level2")
    cfg = parse("--profile-step-start", "1", "--profile-step-end", "9")
    assert (cfg.enabled, cfg.step_start, cfg.step_end, cfg.ranks, cfg.level) == (True, 7, 9, (0, 2), "level2")
    monkeypatch.setenv("ONDEMAND_PROF_LEVEL", "fast")
    with pytest.raises(ConfigError, match=r"invalid ONDEMAND_PROF_LEVEL 'fast': expected one of level_none, "
                                          r"level0, level1, level2"):
        config_from_env()


@pytest.mark.parametrize("argv,message", [
    (["--profile-level", "level9"], "argument --profile-level: invalid value 'level9': expected one of level_none, "
                                    "level0, level1, level2"),
    (["--profile-export-type", "csv"], "argument --profile-export-type: invalid value 'csv': expected one of text, db"),
    (["--profile-step-start", "5", "--profile-step-end", "5"],
     "invalid --profile-step-end 5: expected -1 or a step greater than --profile-step-start (5)"),
    (["--profile-step-start", "-2"], "argument --profile-step-start: invalid value '-2': expected 0 or more"),
    (["--profile-ranks", "0", "x"], "invalid --profile-ranks ['0', 'x']: bad rank 'x': expected an integer"),
    (["--profile-ranks", "0-20000000"], "invalid --profile-ranks ['0-20000000']: rank 20000000 is out of range"),
    (["--profile-signal", "SIGKILL"], "argument --profile-signal: invalid value 'SIGKILL': SIGKILL is reserved"),
    (["--profile-trigger-poll", "nan"], "argument --profile-trigger-poll: invalid value 'nan': expected a finite"),
])
def test_bad_flags_are_one_argparse_error_naming_flag_value_and_accepted(argv, message, capsys):
    """Like any argparse program: one 'error:' line after the usage, exit 2, no traceback."""
    parser = add_profile_args(argparse.ArgumentParser(prog="train.py"))
    with pytest.raises(SystemExit) as exit_:
        config_from_args(parser.parse_args(argv), parser)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("train.py: error: " + message), err[-1]
    assert sum("error:" in line for line in err) == 1 and err[0].startswith("usage: train.py")


def test_ranges_in_profile_ranks_and_minus_one_in_env(monkeypatch):
    assert parse("--profile-ranks", "0-3,8").ranks == (0, 1, 2, 3, 8)
    assert config_from_mapping({"profile_ranks": "0-1"}).ranks == (0, 1)
    monkeypatch.setenv("ONDEMAND_PROF_RANKS", "2,-1")
    assert config_from_env().ranks == (-1,)


def test_unknown_env_var_is_named_with_the_closest_known_one(monkeypatch, caplog):
    monkeypatch.setenv("ONDEMAND_PROF_LEVLE", "level1")
    with caplog.at_level("WARNING"):
        config_from_env()
    assert "unknown environment variable ONDEMAND_PROF_LEVLE ignored (did you mean ONDEMAND_PROF_LEVEL?)" \
        in caplog.text


def test_adding_an_option_is_one_table_entry(monkeypatch):
    """A new window option, declared once, appears as a training flag, a YAML key, an env var, a request field,
    an ondemandctl capture flag, and reaches torch.profiler through its backend mapping."""
    from ondemand_prof.core import options as o
    from ondemand_prof.core.requests import parse_request
    from ondemand_prof.rank.backends.torch_backend import torch_profile_kwargs

    new = o.Option("with_flops", "profile_with_flops", o.parse_bool, False, "Count FLOPs.", ours=True, window=True,
                   torch="kwarg:with_flops", npu="kwarg:with_flops")
    table = (*o.OPTIONS, new)
    config_cls = o.make_config_class(table)
    window_cls = o.make_window_options_class(table)
    train = o.add_profile_args(argparse.ArgumentParser(), table)
    assert train.parse_args(["--profile-with-flops"]).profile_with_flops is True
    monkeypatch.setenv("ONDEMAND_PROF_WITH_FLOPS", "1")
    assert o._build({}, config_cls(), options=table).with_flops is True
    assert parse_request({"with_flops": True}, table).options == {"with_flops": True}
    ctl = argparse.ArgumentParser()
    o.add_window_flags(ctl, table)
    assert o.window_overrides(ctl.parse_args(["--no-with-flops"]), table) == {"with_flops": False}
    kwargs = torch_profile_kwargs(window_cls(with_flops=True), cuda=False, table=table)
    assert kwargs["with_flops"] is True and kwargs["with_stack"] is False


def test_profile_config_is_the_table_written_out_with_real_types() -> None:
    """core/config.py is generated from OPTIONS (scripts/generate.py): a table changed without regenerating it
    fails here; its fields carry the types the parsers return, so editors and type checkers see them."""
    import typing

    from ondemand_prof.core import options as o

    path = Path(o.__file__).with_name("config.py")
    assert path.read_text() == o.render_config_module(), "run: python scripts/generate.py"
    hints = typing.get_type_hints(o.ProfileConfig)
    assert [f for f in hints] == [opt.name for opt in o.OPTIONS]
    assert (hints["ranks"], hints["step_start"], hints["auto_ratio"], hints["with_stack"], hints["level"]) == (
        tuple[int, ...], int, float, bool, str)
    assert o.ProfileConfig().file_mode == 0o640 and list(typing.get_type_hints(o.WindowOptions)) == [
        opt.name for opt in o.window_options()]


def test_the_docs_site_builds_strict_and_its_options_table_is_the_table(tmp_path: Path) -> None:
    """docs/ is a MkDocs site: a broken link or a missing page fails the build (--strict); the configuration
    reference in it is generated from OPTIONS and must be what the table says."""
    from ondemand_prof.core import options as o

    root = Path(o.__file__).resolve().parents[2]
    assert (root / "docs" / "_generated" / "options.md").read_text() == o.render_config_reference(), \
        "run: python scripts/generate.py"
    res = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                         cwd=root, capture_output=True, text=True, timeout=300, env={**os.environ,
                                                                                     "NO_MKDOCS_2_WARNING": "1"})
    assert res.returncode == 0, res.stdout + res.stderr
    page = (tmp_path / "site" / "configuration" / "index.html").read_text()
    assert all(f"<code>{opt.flag}</code>" in page for opt in o.OPTIONS)  # every option, in the built page


@pytest.mark.parametrize("data,message", [
    ({"training": {"profile_level": "high"}}, "invalid training.profile_level 'high': expected one of"),
    ({"training": {"profile_ranks": "all"}}, "invalid training.profile_ranks 'all': bad rank 'all': expected an integer"),
    ({"training": {"profile_step_strat": 3}}, "unknown key training.profile_step_strat"),
    ({"training": {"profile_step_start": 4, "profile_step_end": 2}},
     "invalid training.profile_step_end 2: expected -1 or a step greater than training.profile_step_start (4)"),
])
def test_bad_yaml_keys(data, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config_from_mapping(data)


def test_unwritable_save_path_fails_at_startup(tmp_path):
    tmp_path = Path(tempfile.mkdtemp(prefix="ondemand-ro-", dir="/tmp"))  # reachable by the nobody user
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
    tmp_path.chmod(0o755)
    args = ["--steps", "1", "--profile", "--profile-save-path", str(ro / "sub")]
    if os.geteuid() == 0:  # root writes anywhere: run the training script as nobody
        if not shutil.which("setpriv"):
            pytest.skip("running as root without setpriv")
        ((rc, out, err),) = run_ranks(args, prefix=["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"])
    else:
        ((rc, out, err),) = run_ranks(args)
    assert rc == 2, err
    # the last line is ours (torch may print its own warnings before it, e.g. when numpy is absent)
    assert err.strip().splitlines()[-1] == f"error: invalid --profile-save-path '{ro / 'sub'}': {ro} is not writable by uid " \
                          f"{65534 if os.geteuid() == 0 else os.geteuid()}"


def test_save_path_that_is_a_file_fails_at_startup(tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(ConfigError, match=r"invalid --profile-save-path .* exists and is not a directory"):
        OnDemandProfiler(ProfileConfig(enabled=True, save_path=str(f), ondemand=False))


def test_training_script_prints_one_clear_line(tmp_path):
    ((rc, out, err),) = run_ranks(["--steps", "1", "--profile", "--profile-level", "level9"])
    assert rc == 2
    assert err.count("error:") == 1
    assert err.strip().splitlines()[-1].endswith(
        "error: argument --profile-level: invalid value 'level9': expected one of level_none, level0, level1, level2")


# ----------------------------------------------------------------------------------------------------------
# From test_security.py: the environment's known variables


@pytest.mark.quick
def test_export_sched_is_a_known_variable(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    from ondemand_prof.core import options
    from ondemand_prof.core.options import config_from_env

    # each unknown name is warned once per process: another test may have warned this typo already
    monkeypatch.setattr(options, "_warned_env", set())
    monkeypatch.setenv("ONDEMAND_PROF_EXPORT_SCHED", "nice")  # read by rank/trace_save.py, was warned as unknown
    monkeypatch.setenv("ONDEMAND_PROF_LEVLE", "level1")
    with caplog.at_level("WARNING"):
        config_from_env()
    assert "ONDEMAND_PROF_LEVLE" in caplog.text and "EXPORT_SCHED" not in caplog.text, caplog.text
