"""The launcher's entry point (accel_train/launcher/__main__.py) and its plan's checks, in process:
each bad setting is one line and exit 2 before anything starts; a launcher torchrun started runs the
trainer in place and says which of its own options it ignores."""

import pytest

from accel_train.launcher import __main__ as launcher
from accel_train.launcher import command

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A machine without GPU or NPU tools (nothing probed), the launcher's variables cleared."""
    (tmp_path / "bin").mkdir()
    for name in list(launcher.os.environ):
        if name.startswith(("ACCEL_", "TORCHELASTIC", "PET_", "SLURM", "MA_", "VC_")) or name in (
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "NNODES",
            "NODE_RANK",
            "NPROC_PER_NODE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "TMPDIR",
        ):
            monkeypatch.delenv(name)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    return monkeypatch


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize(
    "variable, value, said",
    [
        (
            "ACCEL_RESTART_DELAY",
            "abc",
            "ACCEL_RESTART_DELAY must be a number of seconds >= 0, got 'abc'",
        ),
        ("ACCEL_RANK_STOP_S", "-1", "ACCEL_RANK_STOP_S must be a number of seconds >= 0, got '-1'"),
        ("TMPDIR", "/nonexistent/tmp", "TMPDIR=/nonexistent/tmp is not a folder"),
    ],
)
def test_a_bad_launcher_setting_is_one_line_before_anything_starts(
    env, capsys, variable, value, said
):
    env.setenv(variable, value)
    assert launcher.main(["--epochs", "1"], python="/nonexistent/python") == 2
    assert one_error_line(capsys).startswith(f"launch.sh: error: {said}")


def test_a_config_that_is_not_utf8_is_named(env, capsys, tmp_path):
    config = tmp_path / "latin1.yaml"
    config.write_bytes("compute_environment: LOCAL_MACHINE\n# caf\xe9\n".encode("latin-1"))
    assert launcher.main(["--dry-run", "--accel_config", str(config)]) == 2
    line = one_error_line(capsys)
    assert line.startswith(
        f"launch.sh: error: accelerate config {config} is invalid: 'utf-8' codec"
    )


def test_without_the_checkouts_configs_the_fix_is_named(env, capsys, tmp_path):
    env.setattr(command, "CONFIG_DIR", tmp_path / "site-packages" / "accelerate_configs")
    assert launcher.main(["--dry-run"]) == 2
    line = one_error_line(capsys)
    assert "no accelerate_configs/ beside this accel_train" in line
    assert line.endswith(
        "run launch.sh from a checkout of accel_train, or pass --accel_config PATH"
    )


def test_ctrl_c_while_the_plan_is_made_is_130_without_a_traceback(env, capsys):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    env.setattr(launcher, "Plan", interrupted)
    assert launcher.main(["--epochs", "1"]) == 130
    assert capsys.readouterr().err == ""


def test_under_torchrun_the_trainer_runs_in_place_and_the_launchers_options_are_named(env, capsys):
    env.setenv("TORCHELASTIC_RUN_ID", "job")
    env.setenv("RANK", "1")
    env.setenv("WORLD_SIZE", "2")
    args = ["--dry-run", "--accel_config", "2proc_cpu", "--max_restarts=3", "--no-preflight"]
    assert launcher.main([*args, "--epochs", "1"], python="py") == 0
    out, err = capsys.readouterr()
    assert out.split()[-4:] == ["-m", "accel_train", "--epochs", "1"]
    assert (
        err.strip()
        == "launch.sh: warning: --accel_config --max_restarts --no-preflight ignored: started by"
        " torchrun, whose agent relaunches, rendezvous and places this rank (its own"
        " --max_restarts, --nnodes, ...)"
    )
    assert launcher.main(["--smoke-test"], python="py") == 2  # never a training run in its place
    assert one_error_line(capsys).startswith("launch.sh: error: --smoke-test under torchrun")
