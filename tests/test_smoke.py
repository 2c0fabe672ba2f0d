"""accel-train smoke: Accelerate's own test script, passing only when the ranks formed the config's
group."""

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from accelerate.test_utils import path_in_accelerate_package
from conftest import CONFIGS, ROOT, clean_env

from accel_train.commands import smoke
from accel_train.commands.smoke import check


def run_smoke(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "accel_train", "smoke", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=clean_env(),
    )


@pytest.mark.launches
@pytest.mark.parametrize("config,ranks", [("cpu.yaml", 1), ("2proc_cpu.yaml", 2)])
def test_smoke_passes_when_every_rank_joined(config, ranks):
    proc = run_smoke("--config_file", CONFIGS / config)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the launch `ACCELERATE_USE_CPU=1 accelerate test --config_file <config>` makes (accelerate's
    # commands/test.py: `accelerate-launch --config_file=<config> <its test_script.py>`; "Test is a
    # success" means that exited 0, which check() requires too); this test replaces
    # test_accelerate_configs' run of `accelerate test` on these two configs
    assert (
        proc.stdout.splitlines()[0]
        == f"smoke: {sys.executable} -m accelerate.commands.launch --config_file "
        f"{CONFIGS / config} {smoke.test_script()} (ACCELERATE_USE_CPU=1)"
    )
    assert (
        smoke.test_script()
        == Path(path_in_accelerate_package("test_utils", "scripts", "test_script.py")).resolve()
    )
    assert re.findall(r"(?m)^Num processes: (\d+)$", proc.stdout) == [str(ranks)] * ranks
    assert sorted(re.findall(r"(?m)^Process index: (\d+)$", proc.stdout)) == [
        str(i) for i in range(ranks)
    ]
    assert (
        proc.stdout.strip().splitlines()[-1]
        == f"smoke: ok: {config}: {ranks} process(es) here (indices 0..{ranks - 1}) in one group of"
        f" {ranks} over 1 machine(s)"
    )


@pytest.mark.launches
def test_what_accelerate_test_calls_a_success_the_smoke_check_calls_a_failure(tmp_path):
    # Exactly what `accelerate test --config_file 2proc_cpu.yaml` runs: no ACCELERATE_USE_CPU, so
    # the two ranks never join one group, and Accelerate's script still exits 0.
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(CONFIGS / "2proc_cpu.yaml"),
        str(smoke.test_script()),
    ]
    # The two lone "main processes" share the script's scratch file and may race on it (then the
    # script fails for that reason); the group size is printed before that, and it is what the smoke
    # check judges.
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=clean_env()
    )
    assert re.findall(r"(?m)^Num processes: (\d+)$", proc.stdout) == ["1", "1"]
    # even with the exit status accelerate test calls a success
    problems = check(proc.stdout, 0, 2, range(2))
    assert len(problems) == 2 and "did not join one group of 2" in problems[0], problems
    assert "expected process indices 0..1 here, got 0, 0" in problems[1]


@pytest.mark.launches
def test_a_launcher_that_starts_fewer_ranks_fails_the_smoke_check(tmp_path):
    # MULTI_CPU goes to accelerate's simple launcher, which starts one process whatever
    # num_processes says
    config = tmp_path / "multi_cpu.yaml"
    config.write_text((CONFIGS / "2proc_cpu.yaml").read_text().replace("MULTI_GPU", "MULTI_CPU"))
    proc = run_smoke("--config_file", config)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("smoke: FAILED for multi_cpu.yaml: expected 2 process(es) here"), (
        lines[-3:]
    )
    assert "got 1: the ranks did not join one group of 2" in lines[-1]
    # and the fix
    assert "one process was started" in lines[-1] and "2proc_cpu.yaml" in lines[-1]


def test_check_needs_every_rank_of_this_machine_and_a_clean_exit():
    rank = (
        "Distributed environment: DistributedType.MULTI_GPU  Backend: nccl\nNum processes:"
        " {n}\nProcess index: {i}\n"
    )
    both = rank.format(n=4, i=2) + "noise\n" + rank.format(n=4, i=3)
    assert check(both, 0, 4, range(2, 4)) == []  # machine 1 of 2, two processes each
    assert "exited with status 1" in check(both, 1, 4, range(2, 4))[0]
    assert "got 2, 3" in check(both, 0, 4, range(0, 2))[0]  # the wrong machine rank
    assert "got 4" in check(rank.format(n=4, i=2), 0, 4, range(2, 4))[0]  # one rank missing
    assert "got none" in check("Test is a success", 0, 2, range(2))[0]


@pytest.mark.parametrize(
    "args,message",
    [
        ([], "--config_file is required"),
        (["--config_file", "nope.yaml"], "--config_file nope.yaml: no such file"),
        (
            ["--config_file", CONFIGS / "2node_cpu.yaml", "--machine_rank", "2"],
            "machine_rank 2 is not below",
        ),
    ],
)
def test_bad_smoke_arguments_are_one_line_errors(args, message):
    proc = run_smoke(*args, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert (
        len(lines) == 1 and lines[0].startswith("accel-train: error: ") and message in lines[0]
    ), lines


@pytest.mark.parametrize("spelling", ["_", "-"])
def test_layout_reads_accelerate_launchs_hyphen_spellings_too(spelling):
    # accelerate launch takes --num-processes / --num-machines / --machine-rank / --config-file as
    # well as the underscore forms (accelerate/commands/launch.py); smoke read only the underscore
    # ones, so a healthy setup spelled with hyphens was judged by the config's counts and rank 0,
    # and failed
    def o(name):
        return "--" + name.replace("_", spelling)

    argv = [
        o("config_file"),
        str(CONFIGS / "2node_cpu.yaml"),
        o("num_processes"),
        "6",
        o("num_machines"),
        "3",
        o("machine_rank"),
        "2",
        "--main_process_ip",
        "h0",
    ]
    assert smoke.layout(argv) == (str(CONFIGS / "2node_cpu.yaml"), 6, 3, 2, True)


def test_a_healthy_run_launched_with_hyphen_options_passes(monkeypatch, capsys):
    # in-process: accelerate launch replaced by its output for 4 processes that joined one group of
    # 4 (the old smoke took the config's 2: "expected 2 process(es) here each reporting 'Num
    # processes: 2', got 4, 4, 4, 4")
    ranks = "".join(f"Num processes: 4\nProcess index: {i}\n" for i in range(4))

    class Launched:
        def __init__(self, cmd, **_):
            assert cmd[3:7] == [
                "--config-file",
                str(CONFIGS / "2proc_cpu.yaml"),
                "--num-processes",
                "4",
            ], cmd
            self.pid, self.stdout = None, iter(ranks.splitlines(keepends=True))

        def wait(self):
            return 0

    monkeypatch.setattr(smoke.subprocess, "Popen", Launched)
    # (no process group to stop at --timeout)
    monkeypatch.setattr(smoke.os, "killpg", lambda *_: None)
    assert (
        smoke.main_smoke(["--config-file", str(CONFIGS / "2proc_cpu.yaml"), "--num-processes", "4"])
        == 0
    )
    out = capsys.readouterr().out
    assert (
        out.strip().splitlines()[-1]
        == "smoke: ok: 2proc_cpu.yaml: 4 process(es) here (indices 0..3) in one "
        "group of 4 over 1 machine(s)"
    )


def tagged(tag: str) -> dict[int, str]:
    """{pid: command line} of the live processes started with ACCEL_TEST_TAG=tag (a /proc scan, no
    psutil)."""
    found = {}
    for d in Path("/proc").iterdir():
        try:
            if (
                d.name.isdigit()
                and f"ACCEL_TEST_TAG={tag}".encode() in (d / "environ").read_bytes().split(b"\0")
                and (d / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
            ):
                found[int(d.name)] = (
                    (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                )
        except OSError:
            pass
    return found


def rank_pid(tag: str, rank: int) -> int | None:
    for pid in tagged(tag):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if (
            f"RANK={rank}".encode() in env
            and b"test_script.py" in cmd
            and b"accelerate.commands.launch" not in cmd
        ):
            return pid
    return None


@pytest.mark.launches
def test_timeout_stops_a_hung_check_and_its_workers(tmp_path):
    # torch elastic starts each worker in a session of its own: killing the launcher's process group
    # left a worker stuck in a collective holding the output pipe, and smoke returned only when it
    # ended (the collective timeout, 30 min by default), leaving it orphaned. Rank 1 is stopped
    # (SIGSTOP) once it has joined the group, so rank 0 waits in the test script's next collective.
    tag, timeout = uuid.uuid4().hex, 40
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "accel_train",
            "smoke",
            "--timeout",
            str(timeout),
            "--config_file",
            CONFIGS / "2proc_cpu.yaml",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=clean_env(ACCEL_TEST_TAG=tag),
        start_new_session=True,
    )
    started, stopped, lines = time.monotonic(), [], []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.strip() == "Process index: 1":
                pid = rank_pid(tag, 1)
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
                break
        assert stopped, "".join(lines)[-3000:]
        out, err = proc.communicate(timeout=timeout + 60)
        elapsed = time.monotonic() - started
        left = tagged(tag)
    finally:
        for pid in tagged(tag):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
    assert proc.returncode == 1, (out[-2000:], err[-2000:])
    assert elapsed < timeout + 10, elapsed
    problems = err.strip().splitlines()
    assert len(problems) == 1 and problems[0].startswith(
        f"smoke: FAILED for 2proc_cpu.yaml: no result within --timeout {timeout}s"
    ), err[-2000:]
    assert left == {}, left  # no worker left behind, the stopped one included
