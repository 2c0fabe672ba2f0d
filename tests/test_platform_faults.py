"""Failure modes that only Ascend / NCCL clusters show, driven on CPU: ModelArts'
per-card boot file, HCCL timeouts below the trainer's, a rank ended by SIGABRT, exact resume without
random-state files, evaluation on unequal shards, and bench/npu_check.sh."""

import re
import signal
import subprocess
import textwrap
import uuid
from datetime import timedelta

import pytest
from conftest import ROOT, TINY, clean_env, launch
from safetensors.torch import load_file
from test_launch import (
    LAUNCH,
    dry_run,
    hw,  # noqa: F401 (a fixture)
    parse,
)

from accel_train.config.train_config import TrainConfig
from accel_train.platform import accelerator, backend_env
from accel_train.training import loop

ASCEND = {"RANK_TABLE_FILE": "/user/config/jobstart_hccl.json", "RANK_ID": "0"}


# ---- 1. ModelArts Ascend-Powered-Engine: the boot file runs once per card ------------------------


@pytest.mark.parametrize("device", ["1", "7"])
def test_ascend_boot_file_copies_of_other_cards_exit_at_once(device):
    proc = dry_run(
        {
            **ASCEND,
            "ASCEND_DEVICE_ID": device,
            "RANK_ID": device,
            "RANK_SIZE": "8",
            "MA_NUM_GPUS": "8",
        }
    )
    assert proc.returncode == 0 and proc.stdout == "", proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert (
        len(lines) == 1
        and f"ASCEND_DEVICE_ID={device}" in lines[0]
        and "device 0's copy" in lines[0]
    ), lines


def test_ascend_boot_file_device0_copy_runs_the_job_for_every_card(hw):
    # one node, no npu-smi in the image: RANK_SIZE (the rank table's cards) gives the processes
    env, opts, _ = parse(
        dry_run({**ASCEND, "ASCEND_DEVICE_ID": "0", "RANK_SIZE": "8"}, bindir=hw())
    )
    assert opts == {"config": "1node_npu.yaml", "--num_machines": "1", "--num_processes": "8"}
    assert "ACCELERATE_USE_CPU" not in env
    # two nodes: RANK_SIZE counts the cards of the whole job (the rank table lists every node's)
    _, opts, _ = parse(
        dry_run(
            {
                **ASCEND,
                "ASCEND_DEVICE_ID": "0",
                "RANK_SIZE": "16",
                "MA_NUM_HOSTS": "2",
                "VC_TASK_INDEX": "1",
                "VC_WORKER_HOSTS": "w0,w1",
            },
            bindir=hw(),
        )
    )
    assert (
        opts["config"] == "2node_npu.yaml"
        and opts["--num_processes"] == "16"
        and opts["--machine_rank"] == "1"
    )
    # npu-smi, where present, counts this node's cards
    _, opts, _ = parse(
        dry_run({**ASCEND, "ASCEND_DEVICE_ID": "0", "RANK_SIZE": "1"}, bindir=hw(npus=4))
    )
    assert opts["--num_processes"] == "4"
    # ASCEND_DEVICE_ID alone (a user's single-card setting) is not that layout: nothing exits
    _, opts, _ = parse(dry_run({"ASCEND_DEVICE_ID": "3"}, bindir=hw(npus=2)))
    assert opts["--num_processes"] == "2"
    proc = dry_run(
        {
            **ASCEND,
            "ASCEND_DEVICE_ID": "0",
            "RANK_SIZE": "12",
            "MA_NUM_HOSTS": "8",
            "VC_TASK_INDEX": "0",
            "VC_WORKER_HOSTS": "w0",
        },
        bindir=hw(),
    )
    assert (
        proc.returncode == 2
        and "RANK_SIZE=12 cards cannot be split evenly over 8 machines" in proc.stderr
    )


# ---- 2. a dead peer is found within --timeout_s on every backend ---------------------------------


def hccl(env):
    return int(env["HCCL_CONNECT_TIMEOUT"]), int(env["HCCL_EXEC_TIMEOUT"])


def test_launch_sets_hccl_timeouts_below_the_trainers(hw):
    env, _, _ = parse(dry_run({}, bindir=hw(npus=8)))
    connect, execute = hccl(env)
    assert (
        120 <= connect < TrainConfig().timeout_s
        and 0 < execute < TrainConfig().timeout_s
        and execute % 68 == 0
    )
    for args, timeout in (
        (["--timeout_s", "1000"], 1000),
        (["--epochs", "1", "--timeout_s=7200"], 7200),
    ):
        env, _, trainer = parse(dry_run({}, args, bindir=hw(npus=8)))
        connect, execute = hccl(env)
        assert (
            120 <= connect < timeout and execute < timeout and execute % 68 == 0 and trainer == args
        )
    # the user's values are kept (the trainer checks them) and the host NIC variables pass through
    env, _, _ = parse(
        dry_run(
            {
                "HCCL_EXEC_TIMEOUT": "68",
                "HCCL_CONNECT_TIMEOUT": "150",
                "HCCL_IF_IP": "10.0.0.5",
                "HCCL_SOCKET_IFNAME": "eth1",
            },
            bindir=hw(npus=8),
        )
    )
    assert (
        hccl(env) == (150, 68)
        and env["HCCL_IF_IP"] == "10.0.0.5"
        and env["HCCL_SOCKET_IFNAME"] == "eth1"
    )
    env, _, _ = parse(dry_run({}, bindir=hw(gpus=2)))
    assert "HCCL_CONNECT_TIMEOUT" not in env


def test_hccl_exec_timeout_is_clamped_to_canns_upper_bound(hw):
    # CANN's environment variable reference bounds HCCL_EXEC_TIMEOUT to (0, 17340] s on the Atlas
    # training series (910A; a multiple of 68, 17340 = 255 * 68); A2/A3 take up to 2147483647. One
    # rule for every NPU: the smaller.
    assert backend_env.HCCL_EXEC_TIMEOUT_MAX == 17340 == 255 * 68
    # three quarters would be 64800
    assert backend_env.derived_hccl_timeouts(86400) == (
        7200,
        17340,
    )
    assert backend_env.derived_hccl_timeouts(23188) == (7200, 17340)  # 17391 -> 17340
    assert backend_env.derived_hccl_timeouts(23120) == (7200, 17340)  # exactly 17340
    # 17250 -> 253 * 68, below the bound
    assert backend_env.derived_hccl_timeouts(23000) == (
        7200,
        17204,
    )
    for timeout in (91, 300, 1000, 7200, 23120, 10**6, 10**9):
        connect, execute = backend_env.derived_hccl_timeouts(timeout)
        assert (
            68 <= execute <= 17340
            and execute % 68 == 0
            and execute < timeout
            and 120 <= connect <= 7200
        )
    env = {}
    accelerator.hccl_timeouts(86400, env)
    assert env == {"HCCL_CONNECT_TIMEOUT": "7200", "HCCL_EXEC_TIMEOUT": "17340"}
    proc = dry_run({}, ["--timeout_s", "86400"], bindir=hw(npus=8))  # launch.sh says so
    assert hccl(parse(proc)[0]) == (7200, 17340)
    assert "launch.sh: HCCL_EXEC_TIMEOUT=17340: capped at CANN's upper bound" in proc.stderr
    assert "capped" not in dry_run({}, ["--timeout_s", "7200"], bindir=hw(npus=8)).stderr


def test_the_launcher_reads_the_trainers_seconds_as_argparse_does_rounded_up():
    """The frozen-rank limit (--heartbeat_timeout_s + FROZEN_MARGIN_S) and HCCL timeouts read the
    trainer's flags: the last one given wins, fractions round up, 08 is decimal, what is not a plain
    number falls back to the default (TrainConfig's own: the launcher reads it from there)."""
    from accel_train.launcher import plan as launcher
    from accel_train.launcher.options import trainer_seconds

    cases = {
        "--heartbeat_timeout_s 2.5": 3,
        "--heartbeat_timeout_s=08": 8,
        "--heartbeat_timeout_s 15.0": 15,
        "--heartbeat_timeout_s 1e2": 15,
        "--heartbeat_timeout_s 9 --heartbeat_timeout_s 20": 20,
        "": 15,
    }
    default = TrainConfig().heartbeat_timeout_s
    for args, want in cases.items():
        argv = args.split()
        assert trainer_seconds(argv, "--heartbeat_timeout_s", default) == want, args
        assert (
            launcher.frozen_limit_s(2, argv) == want + 3 and launcher.frozen_limit_s(1, argv) == 0
        )
    assert launcher.frozen_limit_s(2, ["--heartbeat_timeout_s", "0", "--timeout_s", "40.2"]) == 44
    assert launcher.frozen_limit_s(2, ["--heartbeat_timeout_s", "0"]) == TrainConfig().timeout_s + 3
    assert launcher.trainer_timeout_s([]) == TrainConfig().timeout_s


def test_trainer_sets_unset_hccl_timeouts_as_launch_sh_does_and_refuses_ones_not_below_timeout(
    hw,
):
    env = {}
    # plain `accelerate launch` on NPU: set below --timeout_s, like launch.sh
    accelerator.hccl_timeouts(300, env)
    for timeout in (
        300,
        1000,
        7200,
        23188,
        86400,
    ):
        # (the last two: EXEC at CANN's upper bound, 17340)
        launched, _, _ = parse(dry_run({}, ["--timeout_s", str(timeout)], bindir=hw(npus=8)))
        assert hccl(launched) == backend_env.derived_hccl_timeouts(timeout)
    assert (
        int(env["HCCL_CONNECT_TIMEOUT"]),
        int(env["HCCL_EXEC_TIMEOUT"]),
    ) == backend_env.derived_hccl_timeouts(300)
    kept = {"HCCL_CONNECT_TIMEOUT": "225", "HCCL_EXEC_TIMEOUT": "0"}
    accelerator.hccl_timeouts(300, kept)
    assert kept == {"HCCL_CONNECT_TIMEOUT": "225", "HCCL_EXEC_TIMEOUT": "0"}
    for timeout, env, needle in (
        (100, {}, "HCCL_CONNECT_TIMEOUT (120 s, its least value)"),
        (300, {"HCCL_CONNECT_TIMEOUT": "1800"}, "HCCL_CONNECT_TIMEOUT (1800 s, set to 1800)"),
        (300, {"HCCL_EXEC_TIMEOUT": "1836"}, "HCCL_EXEC_TIMEOUT (1836 s, set to 1836)"),
        (300, {"HCCL_CONNECT_TIMEOUT": "soon"}, "HCCL_CONNECT_TIMEOUT='soon' is not a number"),
    ):
        with pytest.raises(accelerator.ConfigError, match=re.escape(needle)):
            accelerator.hccl_timeouts(timeout, env)


def test_on_npu_the_cli_refuses_an_hccl_exec_timeout_above_timeout_s_in_one_line(
    monkeypatch, capsys, tmp_path
):
    from accel_train import cli

    # an Ascend host, as torch_npu reports it
    monkeypatch.setattr(accelerator, "is_npu_available", lambda: True)
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "1836")  # the user's own (HCCL's default value)
    monkeypatch.setenv("HCCL_CONNECT_TIMEOUT", "120")
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    try:
        code = cli.main(["--output_dir", str(tmp_path / "out")])
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(
        "accel-train: error: --timeout_s 300 must be above HCCL_EXEC_TIMEOUT (1836 s"
    )
    assert not (tmp_path / "out").exists()


def test_trainer_never_names_a_process_group_backend(monkeypatch):
    """Accelerate picks hccl on NPU (and raises if InitProcessGroupKwargs names another); only the
    timeout is ours."""
    seen = {}

    class Capture:
        num_processes = 1

        def __init__(self, **kwargs):
            seen.update(kwargs)

    monkeypatch.setattr(accelerator, "Accelerator", Capture)
    monkeypatch.setattr(
        accelerator, "logger", type("Quiet", (), {"info": lambda self, *a, **k: None})()
    )
    accelerator.make_accelerator(TrainConfig(timeout_s=123))
    init = [h for h in seen["kwargs_handlers"] if isinstance(h, accelerator.InitProcessGroupKwargs)]
    assert len(init) == 1 and init[0].to_kwargs() == {"timeout": timedelta(seconds=123)}


ABORT_HOOK = textwrap.dedent("""\
    # test only: rank 1 of the trainer dies of SIGABRT (as NCCL's watchdog ends it) once a
    # checkpoint exists; its abort note names the backend NCCL's (launch.sh reads a gloo rank's
    # SIGABRT as a bug: test_faults.py)
    import os, pathlib, sys, threading, time
    _cmd = open("/proc/self/cmdline", "rb").read().split(b"\\0")
    _abort_after = os.environ.get("ACCEL_TEST_ABORT_AFTER")
    if os.environ.get("RANK") == "1" and b"accel_train" in _cmd and _abort_after:
        _after, _once = pathlib.Path(_abort_after), pathlib.Path(os.environ["ACCEL_TEST_ONCE"])
        def _watch():
            while not _after.exists():
                time.sleep(0.05)
            if not _once.exists():
                _once.touch()
                for _note in sys.modules["accel_train.exits"]._fault_notes:
                    _note.seek(0)
                    _note.truncate()
                    _note.write("backend: nccl\\n")
                    _note.flush()
                os.abort()
        threading.Thread(target=_watch, daemon=True).start()
    """)


@pytest.mark.faults
def test_rank_ended_by_sigabrt_is_a_lost_peer_and_is_relaunched(tmp_path):
    hooks, out = tmp_path / "hooks", tmp_path / "out"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(ABORT_HOOK)
    env = clean_env(
        NPROC_PER_NODE="2",
        ACCEL_RESTART_DELAY="1",
        PYTHONPATH=str(hooks),
        ACCEL_TEST_ABORT_AFTER=str(out / "checkpoints" / "step_00000002"),
        ACCEL_TEST_ONCE=str(tmp_path / "aborted"),
        ACCEL_TEST_TAG=uuid.uuid4().hex,
    )
    proc = subprocess.run(
        [
            "bash",
            str(LAUNCH),
            "--max_restarts",
            "1",
            "--train_samples",
            "32",
            "--test_samples",
            "8",
            "--epochs",
            "2",
            "--batch_size",
            "4",
            "--checkpoint_every",
            "2",
            "--output_dir",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=400,
    )
    text = proc.stdout + proc.stderr
    assert (tmp_path / "aborted").exists(), text[-3000:]
    assert proc.returncode == 0, text[-4000:]
    assert "a rank ended by SIGABRT" in text and "a lost peer (exit status 3)" in text
    assert "relaunching to resume from the newest checkpoint" in text and "(attempt 2 of 2)" in text
    assert "resumed from" in text and (out / "model.safetensors").is_file()


# ---- 4. exact resume without Accelerate's random-state files -------------------------------------

DROP = ["--model_kwargs", '{"drop_rate": 0.3, "drop_path_rate": 0.1}']


def worst(a, b):
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.mark.launches
def test_resume_without_random_state_files_is_exact_with_dropout(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    # 8 steps; step 5's checkpoint kept
    run = [
        *TINY,
        "--train_samples",
        "128",
        "--test_samples",
        "8",
        "--epochs",
        "2",
        "--batch_size",
        "16",
        *DROP,
        "--checkpoint_every",
        "5",
        "--keep_checkpoints",
        "3",
    ]
    launch("2proc_cpu.yaml", run + ["--output_dir", full])
    ckpt = full / "checkpoints" / "step_00000005"
    rng = sorted(ckpt.glob("random_states_*.pkl"))
    assert [p.name for p in rng] == ["random_states_0.pkl", "random_states_1.pkl"]
    for p in rng:
        p.unlink()
    env = clean_env(ACCELERATE_LOG_LEVEL="INFO")  # accelerate's own notices shown, were there any
    proc = launch("2proc_cpu.yaml", run + ["--output_dir", part, "--resume", ckpt], env=env)
    assert (
        "step 5, " in proc.stderr
        and "Could not load random states" not in proc.stdout + proc.stderr
    )
    assert [r for r in range(2) if f"no RNG state for rank {r} " in proc.stderr] == [0, 1]
    assert (
        worst(load_file(full / "model.safetensors"), load_file(part / "model.safetensors")) <= 1e-6
    )


def test_draw_seed_depends_on_seed_step_micro_batch_and_rank_only():
    seeds = {
        loop.draw_seed(s, t, m, r) for s in (1, 2) for t in (0, 7) for m in (0, 1) for r in (0, 3)
    }
    assert len(seeds) == 16 and all(0 <= s < 2**63 for s in seeds)
    assert loop.draw_seed(42, 5, 0, 1) == loop.draw_seed(42, 5, 0, 1)


# ---- 5. evaluation on unequal shards -------------------------------------------------------------


@pytest.mark.launches
def test_evaluation_on_three_unequal_shards_equals_one_process(tmp_path):
    out = tmp_path / "out"
    launch(
        "cpu.yaml",
        [
            *TINY,
            "--train_samples",
            "64",
            "--test_samples",
            "8",
            "--epochs",
            "1",
            "--batch_size",
            "16",
            "--output_dir",
            out,
        ],
    )
    # 23 < 3 x 4 x 2
    evaluate = [
        "evaluate",
        "--checkpoint",
        out,
        "--test_samples",
        "23",
        "--batch_size",
        "4",
    ]
    one = launch("cpu.yaml", evaluate)
    three = launch(
        "2proc_cpu.yaml",
        evaluate,
        launcher=("--num_processes", 3),
        env=clean_env(ACCELERATE_DEBUG_MODE="1"),
    )
    assert (
        "on 23 samples (1 process(es))" in one.stdout
        and "on 23 samples (3 process(es))" in three.stdout
    )

    def table(text):
        lines = text.splitlines()
        start = next(i for i, line in enumerate(lines) if "test accuracy" in line)
        return [re.sub(r"\(\d process\(es\)\)", "", line) for line in lines[start : start + 12]]

    assert table(one.stdout) == table(three.stdout)


# ---- 6. bench/npu_check.sh -----------------------------------------------------------------------

NPU_CHECK = ROOT / "bench" / "npu_check.sh"


def test_npu_check_dry_run_prints_its_plan_and_the_results_block(tmp_path):
    proc = subprocess.run(
        ["bash", str(NPU_CHECK), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(OUT=str(tmp_path)),
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    for step in ("smoke", "train", "resume", "throughput"):
        assert f"== {step}" in text, text
    assert "1node_npu.yaml" in text and "--resume auto" in text and "--mixed_precision" in text
    assert "bench/RESULTS.md" in text


def test_npu_check_without_an_npu_says_so_in_one_line(tmp_path):
    proc = subprocess.run(
        ["bash", str(NPU_CHECK)],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(OUT=str(tmp_path)),
        cwd=ROOT,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no Ascend NPU" in lines[0], proc.stderr
