"""Two real network hosts (namespaces + veth), each running launch.sh as its platform would."""

import json
import os
import random
import re
import shutil
import signal
import subprocess
import uuid
from pathlib import Path

import pytest
from conftest import ROOT, TINY, launch, steps_logged, trainer_pids, wait_all, wait_for, write_cifar
from safetensors.torch import load_file

pytestmark = pytest.mark.hosts
TRAIN = ["--train_samples", "128", "--test_samples", "37", "--epochs", "1", "--batch_size", "16"]


def logs(paths):
    return [p.read_text() for p in paths]


# The ModelArts job (test_modelarts_job_on_two_hosts) and the plain variables with a shared
# --output_dir (test_plain_variables_on_two_hosts_with_shared_output) each had a two-host run of
# their own; their assertions now live in the runs that already make those launches:
# - ModelArts variables and boot arguments, the rank-0 DNS name, one writer under --log_all_ranks,
#   node 1 writing no model, the odd test-set count: the reference run of
#   test_machines_lost_with_their_disks_resume_from_a_surviving_copy (the same ModelArts launch);
# - the plain variables on a shared --output_dir: test_matrix.py's two-host run (exit 0, one
#   complete checkpoint, the model) and test_faults.py's node loss (every rank's RNG state in the
#   one shared checkpoint).


def test_smoke_check_on_two_hosts(two_hosts, tmp_path):
    # The documented smoke check of a two-machine setup: launch.sh --smoke-test on each machine,
    # which runs Accelerate's test script with that machine's rank and the rank-0 address, and
    # checks the group size.
    procs, paths = two_hosts.launch_plain(["--smoke-test"], tmp_path)
    codes = wait_all(procs, timeout=300)
    text = logs(paths)
    assert codes == [0, 0], "\n\n".join(t[-3000:] for t in text)
    for node in (0, 1):
        assert re.findall(r"(?m)^Num processes: (\d+)$", text[node]) == ["2"]
        assert re.findall(r"(?m)^Process index: (\d+)$", text[node]) == [str(node)]
        assert (
            f"smoke: ok: 2node_cpu.yaml: 1 process(es) here (indices {node}..{node}) in one group"
            " of 2 over 2 machine(s)" in text[node]
        )


# ---------------------------------------------------------------------------------------------
# The run lifecycle without a shared disk: ModelArts layout (each machine its own --train_url),
# machines lost with or without their disks, launch.sh --max_restarts relaunching on both.
# ---------------------------------------------------------------------------------------------

# 37 test samples: not a multiple of the 2 ranks, the evaluation must still count each sample once
# resnet18 at 4 images per rank: ~0.3 s a step, long enough for each kill to land mid-run
LIFE = [
    "--train_samples",
    "128",
    "--test_samples",
    "37",
    "--epochs",
    "2",
    "--batch_size",
    "4",
    "--checkpoint_every",
    "8",
    "--log_every",
    "1",
    "--timeout_s",
    "60",
]


def modelarts_job(two_hosts, tmp_path, name, port, extra=(), tags=("", "")):
    procs, paths, outs = [], [], []
    for node in (0, 1):
        env = two_hosts.env(
            node,
            MA_NUM_HOSTS="2",
            VC_TASK_INDEX=str(node),
            VC_WORKER_HOSTS=",".join(two_hosts.names),
            MA_JOB_DIR=str(ROOT),
            ACCEL_TEST_TAG=tags[node],
            ACCEL_RESTART_DELAY="4",
        )
        outs.append(tmp_path / name / f"node{node}" / "train_url_0")
        args = [
            ROOT / "launch.sh",
            *LIFE,
            *extra,
            f"--train_url={outs[-1]}/",
            "--init_method",
            f"tcp://{two_hosts.names[0]}:{port}",
            "--rank",
            str(node),
            "--world_size",
            "2",
        ]
        paths.append(tmp_path / f"{name}-node{node}.log")
        procs.append(two_hosts.popen(node, ["bash", *args], env, paths[-1]))
    return procs, paths, outs


def test_machines_lost_with_their_disks_resume_from_a_surviving_copy(two_hosts, tmp_path):
    # the uninterrupted run, launched the same way (threads per rank change float results)
    port = random.randint(20000, 40000)
    procs, paths, ref = modelarts_job(two_hosts, tmp_path, "ref", port, ["--log_all_ranks"])
    codes = wait_all(procs, timeout=300)
    text = logs(paths)
    assert codes == [0, 0], "\n\n".join(t[-3000:] for t in text)
    assert "a whole copy on each machine's disk" in text[0]
    # a ModelArts job (MA_NUM_HOSTS, VC_TASK_INDEX, VC_WORKER_HOSTS, --train_url=...,
    # --init_method/--rank/
    # --world_size): one group of 2 ranks, node 1 reaching rank 0 by its DNS name
    assert "2 process(es) [DistributedType.MULTI_CPU" in text[0]
    assert f"rank 0 at {two_hosts.names[0]}:{port}" in text[1]
    # only the main process exports the model, even with every rank logging; node 1's --train_url
    # gets no model
    writes = re.findall(r"rank \d+/\d+ wrote \S+", "\n".join(text))
    assert writes == [f"rank 0/2 wrote {ref[0]}/model.safetensors"], writes
    assert (ref[0] / "model.safetensors").is_file() and not (ref[1] / "model.safetensors").exists()
    assert "(37 samples)" in text[0]
    # each machine's disk holds a whole checkpoint: every rank's RNG state, the model, the run's
    # rows
    for out in ref:
        newest = sorted((out / "checkpoints").glob("step_*"))[-1]
        assert {
            "model.safetensors",
            "optimizer.bin",
            "random_states_0.pkl",
            "random_states_1.pkl",
            "trainer_state.json",
            "metrics.jsonl",
        } <= {p.name for p in newest.iterdir()}, newest

    # --checkpoint_every 0 (the default): between epoch ends, only the survivors' saves
    tags = (uuid.uuid4().hex, uuid.uuid4().hex)
    procs, paths, outs = modelarts_job(
        two_hosts,
        tmp_path,
        "run",
        random.randint(20000, 40000),
        ["--max_restarts", "2", "--checkpoint_every", "0"],
        tags,
    )

    def kill(node, wipe, after_step):
        wait_for(lambda: steps_logged(outs[0]) >= after_step, timeout=240, interval=0.01)
        pid = wait_for(lambda: trainer_pids(tags[node]).get(node), timeout=60)
        logged = steps_logged(outs[0])
        os.kill(pid, signal.SIGKILL)
        if wipe:  # the machine is replaced by one with an empty disk
            shutil.rmtree(outs[node])
        return logged

    # (a killed rank whose disk survives is relaunched and resumed: test_preempt.py, on one machine)
    try:
        # node 1 lost with its disk: node 0's survivor saves the step
        logged = [kill(1, wipe=True, after_step=6)]
        wait_for(lambda: "relaunching to resume" in paths[1].read_text(), timeout=120)
        # machine 0 lost with its disk: node 1's survivor saves
        logged.append(kill(0, wipe=True, after_step=22))
    finally:
        codes = wait_all(procs, timeout=400)
    text = [p.read_text() for p in paths]
    assert codes == [0, 0], "\n\n".join(t[-4000:] for t in text)
    assert (
        text[0].count("relaunching to resume") == 2 and text[1].count("relaunching to resume") == 2
    )
    # each kill: the surviving machine saved the step no earlier than the last one logged, without a
    # collective
    saved = [int(re.findall(r"step (\d+) saved by the survivor", text[node])[0]) for node in (0, 1)]
    assert saved[0] >= logged[0] and saved[1] >= logged[1] and saved[1] % 16, (saved, logged)
    # a copy was sent to each machine that lacked it: node 1 after its disk went, then machine 0
    # from node 1's copy
    copies = [
        int(s) for s in re.findall(r"rank\(s\) \[(?:0|1)\] lack checkpoint step (\d+)", text[0])
    ]
    assert copies == saved, (copies, saved)
    a, b = load_file(ref[0] / "model.safetensors"), load_file(outs[0] / "model.safetensors")
    params = {
        k for k in a if not k.endswith(("running_mean", "running_var", "num_batches_tracked"))
    }
    assert max((a[k].double() - b[k].double()).abs().max().item() for k in params) <= 1e-6
    # BatchNorm's running statistics: rank 1's own where machine 0 was lost between windows
    # (docs/failures.md: What a failure costs): its last step's local update, decayed by 0.9 per
    # later step
    assert (
        max((a[k].double() - b[k].double()).abs().max().item() for k in a if k not in params)
        <= 0.05
    )
    rows = [json.loads(line) for line in (outs[0] / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2]  # the history survived machine 0's empty disk


def test_machines_that_disagree_stop_at_start_in_one_line(two_hosts, tmp_path):
    data = write_cifar(tmp_path / "data")

    def job(extra1, name, common=()):
        port, procs, paths = random.randint(20000, 40000), [], []
        for node in (0, 1):
            env = two_hosts.env(
                node,
                NNODES="2",
                NODE_RANK=str(node),
                MASTER_ADDR=two_hosts.ip[0],
                MASTER_PORT=str(port),
            )
            args = [
                *TRAIN,
                "--data",
                "cifar10",
                "--output_dir",
                tmp_path / name / f"node{node}",
                "--data_dir",
                data,
                "--batch_size",
                "8",
                *common,
                *(extra1 if node == 1 else []),
            ]
            paths.append(tmp_path / f"{name}-node{node}.log")
            procs.append(
                two_hosts.popen(
                    node, ["bash", ROOT / "launch.sh", "--max_restarts", "1", *args], env, paths[-1]
                )
            )
        codes = wait_all(procs, timeout=120)
        return codes, [p.read_text() for p in paths]

    # another --batch_size on machine 1: refused on both machines, naming the flag, no relaunch, no
    # hang
    codes, text = job(["--batch_size", "16"], "flags")
    assert codes == [2, 2], "\n\n".join(t[-3000:] for t in text)
    for t in text:
        assert "relaunching" not in t
    errors = [line for line in text[0].splitlines() if line.startswith("accel-train: error:")]
    assert len(errors) == 1 and "--batch_size is 8 on rank 0 but 16 on rank 1" in errors[0], text[
        0
    ][-2000:]
    # machine 1 lacks the data: both stop with machine 1's cause; under --overwrite, each machine's
    # own disk keeps the earlier run it holds (set aside only once every input is checked)
    earlier = [
        tmp_path / "data" / f"node{node}" / "checkpoints" / "step_00000003" for node in (0, 1)
    ]
    for ckpt in earlier:
        ckpt.mkdir(parents=True)
        (ckpt / "trainer_state.json").write_text(
            json.dumps({"step": 3, "epoch": 0, "run_id": "earlier"})
        )
    codes, text = job(["--data_dir", tmp_path / "nowhere"], "data", ["--overwrite"])
    assert codes == [2, 2], "\n\n".join(t[-3000:] for t in text)
    errors = [line for line in text[0].splitlines() if line.startswith("accel-train: error:")]
    assert len(errors) == 1 and "rank 1: data directory" in errors[0] and "nowhere" in errors[0], (
        text[0][-2000:]
    )
    assert not (tmp_path / "data" / "node0" / "model.safetensors").exists()
    assert (
        all(ckpt.is_dir() for ckpt in earlier) and "--overwrite: setting" not in text[0] + text[1]
    )
    # the same flags, but each machine's own copy of the data differs in size: refused, not a hang
    small = write_cifar(tmp_path / "small", rows=(7, 5, 6, 9, 1))
    codes, text = job(["--data_dir", small], "size")
    assert codes == [2, 2], "\n\n".join(t[-3000:] for t in text)
    errors = [line for line in text[0].splitlines() if line.startswith("accel-train: error:")]
    assert len(errors) == 1 and "the machines disagree on the data" in errors[0], text[0][-2000:]
    # (--resume auto on one machine only, a replaced machine started without it: the same flag
    # check, test_resume.py's test_the_flags_every_machine_must_share_...)


# ---------------------------------------------------------------------------------------------
# An earlier run on the machines' own disks: one two-host fixture, short jobs that stop at start-up,
# and one --overwrite job relaunched by launch.sh. Run A: one process in this test process (a copy
# of its checkpoint placed on each machine's disk as each job needs it).
# ---------------------------------------------------------------------------------------------

SMALL = [*TINY, "--train_samples", "64", "--test_samples", "8", "--plot", "false"]


def rank0_trainer(tag: str) -> int | None:
    """The pid of the trainer's rank 0 (a worker torchrun started: RANK=0 in its environment), not
    launch.sh's own `python -m accel_train` checks."""
    for pid in trainer_pids(tag).values():
        try:
            if b"RANK=0" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return pid
        except OSError:
            continue
    return None


def errors_in(text: str) -> list[str]:
    return [
        line[line.index("accel-train: error:") :]
        for line in text.splitlines()
        if "accel-train: error:" in line
    ]


def test_an_earlier_run_on_the_machines_own_disks(two_hosts, tmp_path):
    run_a = tmp_path / "run_a"
    launch(
        "cpu.yaml",
        [
            *SMALL,
            "--batch_size",
            "16",
            "--epochs",
            "2",
            "--max_steps",
            "4",
            "--checkpoint_every",
            "4",
            "--output_dir",
            run_a,
        ],
    )
    ckpt_a = run_a / "checkpoints" / "step_00000004"
    id_a = json.loads((ckpt_a / "trainer_state.json").read_text())["run_id"]

    def place(out):  # a copy of run A's checkpoint on a machine's disk
        shutil.copytree(ckpt_a, out / "checkpoints" / ckpt_a.name)

    def job(name, outs, extra=(), restarts=0, tags=("", ""), wait=True):
        port, procs, paths = random.randint(20000, 40000), [], []
        for node in (0, 1):
            env = two_hosts.env(
                node,
                NNODES="2",
                NODE_RANK=str(node),
                MASTER_ADDR=two_hosts.ip[0],
                MASTER_PORT=str(port),
                ACCEL_TEST_TAG=tags[node],
                ACCEL_RESTART_DELAY="1",
            )
            args = [
                "--max_restarts",
                restarts,
                *SMALL,
                "--batch_size",
                "8",
                "--timeout_s",
                "60",
                "--output_dir",
                outs[node],
                *extra,
            ]
            paths.append(tmp_path / f"{name}-node{node}.log")
            procs.append(two_hosts.popen(node, ["bash", ROOT / "launch.sh", *args], env, paths[-1]))
        if not wait:
            return procs, paths
        codes = wait_all(procs, timeout=180)
        return codes, [p.read_text() for p in paths]

    def stopped_at_start(codes, text):
        assert codes == [2, 2], "\n\n".join(t[-3000:] for t in text)
        # (torchrun's own summary only)
        assert not re.search(r'File ".*accel_train/', text[0] + text[1]), text
        assert "relaunching" not in text[0] + text[1]
        errors = errors_in(text[0]) + errors_in(text[1])
        assert len(errors) == 1, errors  # said once, by rank 0
        return errors[0]

    # 14. only machine 1's disk holds run A (an unfinished run with these settings): the line names
    # machine 1's folder and says what it holds, not rank 0's (empty) folder
    outs = [tmp_path / "j14" / f"node{node}" for node in (0, 1)]
    place(outs[1])
    line = stopped_at_start(*job("j14", outs))
    assert f"{outs[1]}/checkpoints holds an unfinished run with these settings" in line, line
    assert "rank 1" in line and str(outs[0]) not in line and "--resume auto" in line, line

    # 13. machine 1 cannot store the copy machine 0 sends (a full disk): one line, exit 2 on both,
    # nothing partial
    outs = [tmp_path / "j13" / "node0", tmp_path / "j13" / "small"]
    place(outs[0])
    outs[1].mkdir(parents=True)
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(outs[1])],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if mount.returncode != 0:
        pytest.skip(f"mount refused here: {mount.stderr.strip()}")
    try:
        line = stopped_at_start(*job("j13", outs, ["--resume", "auto"]))
        assert "cannot store" in line and "step_00000004" in line and "rank 1" in line, line
        assert "No space left on device" in line and str(outs[1]) in line, line
        assert not any(outs[1].rglob("*step_*")), list(outs[1].rglob("*"))
    finally:
        subprocess.run(["umount", "-l", str(outs[1])], capture_output=True, timeout=30)
    # ... nor a sender that cannot read its files (an I/O error: /proc/self/mem at offset 0 reads
    # EIO)
    outs = [tmp_path / "j13r" / f"node{node}" for node in (0, 1)]
    place(outs[0])
    broken = outs[0] / "checkpoints" / ckpt_a.name / "optimizer.bin"
    broken.unlink()
    broken.symlink_to("/proc/self/mem")
    state = outs[0] / "checkpoints" / ckpt_a.name / "trainer_state.json"
    meta = json.loads(state.read_text())
    # (its size as read: 0)
    state.write_text(json.dumps({**meta, "files": {**meta["files"], "optimizer.bin": 0}}))
    line = stopped_at_start(*job("j13r", outs, ["--resume", "auto"]))
    assert "cannot read" in line and "optimizer.bin" in line and "rank 0" in line, line
    assert not (outs[1] / "checkpoints").exists() or not any((outs[1] / "checkpoints").iterdir())

    # 11. launch.sh --max_restarts 1 ... --overwrite true, a trainer killed during start-up (before
    # run A is set aside): the relaunch (launch.sh adds --resume auto) starts the new run afresh,
    # never continuing run A
    outs = [tmp_path / "j11" / f"node{node}" for node in (0, 1)]
    for out in outs:
        place(out)
    tags = (uuid.uuid4().hex, uuid.uuid4().hex)
    # (killed before its group exists: machine 1's trainer notices at --timeout_s)
    procs, paths = job(
        "j11",
        outs,
        ["--overwrite", "true", "--lr", "0.05", "--epochs", "3", "--timeout_s", "15"],
        restarts=1,
        tags=tags,
        wait=False,
    )
    try:
        pid = wait_for(lambda: rank0_trainer(tags[0]), timeout=120, interval=0.02)
        os.kill(pid, signal.SIGKILL)
        assert (outs[0] / "checkpoints" / ckpt_a.name).is_dir()  # killed before run A was set aside
    finally:
        codes = wait_all(procs, timeout=300)
    text = logs(paths)
    assert codes == [0, 0], "\n\n".join(t[-4000:] for t in text)
    assert "relaunching" in text[0] and "relaunching" in text[1]
    assert "resumed from" not in text[0] + text[1], text[0][-3000:]
    for out in outs:
        states = [
            json.loads((p / "trainer_state.json").read_text())
            for p in (out / "checkpoints").glob("step_*")
        ]
        assert states and all(s["run_id"] != id_a for s in states), states
        assert not list((out / "checkpoints").glob(".overwritten-*"))
    assert (outs[0] / "model.safetensors").is_file()
