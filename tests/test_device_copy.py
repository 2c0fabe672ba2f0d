"""On NCCL and HCCL a failed collective reaches the training thread as an exception
(the settings, set by the trainer and by launch.sh, a user's own kept), NCCL's own failure texts are
lost peers, and the survivor save's copy off the device waits on nothing but its own side stream
(docs/failures.md). No GPU here: the device side is mocked, as torch and torch_npu would present
it."""

import collections
import os
import time

import pytest
import torch
from test_launch import (
    dry_run,
    hw,  # noqa: F401 (a fixture)
    parse,
)
from torch.distributed import DistBackendError

from accel_train.config.train_config import TrainConfig
from accel_train.errors import is_lost_peer
from accel_train.platform import accelerator, backend_env, hardware
from accel_train.resilience import device_copy

NAMES = (
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "NCCL_ASYNC_ERROR_HANDLING",
    "TORCH_HCCL_ASYNC_ERROR_HANDLING",
    "HCCL_ASYNC_ERROR_HANDLING",
    "HCCL_CONNECT_TIMEOUT",
    "HCCL_EXEC_TIMEOUT",
    "TORCHELASTIC_RUN_ID",
    *(n for names in backend_env.MONITOR_ENV.values() for n in names),
)


@pytest.fixture
def clean_env():
    """os.environ without the settings (failure_env writes to the real one, as it must before the
    process group)."""
    saved = {n: os.environ.pop(n) for n in NAMES if n in os.environ}
    yield os.environ
    for n in NAMES:
        os.environ.pop(n, None)
    os.environ.update(saved)


def test_failure_env_sets_what_the_user_did_not():
    env = {}
    assert accelerator.failure_env("cuda", env) == env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    env = {}
    assert (
        accelerator.failure_env("npu", env)
        == env
        == {
            "TORCH_HCCL_ASYNC_ERROR_HANDLING": "0",
            "HCCL_ASYNC_ERROR_HANDLING": "0",
        }
    )
    # gloo raises in the calling thread already
    assert accelerator.failure_env("cpu", env := {}) == env == {}
    for kind, given in (
        ("cuda", {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}),  # the user's own, under either name
        ("cuda", {"NCCL_ASYNC_ERROR_HANDLING": "1"}),
        # (torch_npu would read a TORCH_HCCL_ one first)
        (
            "npu",
            {"HCCL_ASYNC_ERROR_HANDLING": "1"},
        ),
        ("npu", {"TORCH_HCCL_ASYNC_ERROR_HANDLING": "3"}),
        ("cuda", {"TORCHELASTIC_RUN_ID": "x", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}),
    ):
        env = dict(given)
        assert accelerator.failure_env(kind, env) == {} and env == given
    # torchrun's agent gives every worker TORCH_NCCL_ASYNC_ERROR_HANDLING=1 when its own environment
    # lacks the name
    env = {"TORCHELASTIC_RUN_ID": "x", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    accelerator.failure_env("cuda", env)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}  # not under torchrun: the user's
    assert (
        accelerator.failure_env("cuda", env) == {} and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    )


@pytest.mark.parametrize("kind", ["cuda", "npu"])
def test_the_trainer_sets_them_before_the_process_group_exists(monkeypatch, clean_env, kind):
    """Accelerate makes the process group inside Accelerator() (state.py PartialState:
    init_process_group), where the backend reads these variables; make_accelerator sets them before,
    on the device accelerate would use.
    """
    import accelerate.utils

    seen = {}

    class Capture:  # the Accelerator: what the process group would see when it is made
        num_processes = 1

        def __init__(self, **kwargs):
            seen.update({n: os.environ.get(n) for n in NAMES})

    monkeypatch.setattr(accelerator, "Accelerator", Capture)
    monkeypatch.setattr(
        accelerator, "logger", type("Quiet", (), {"info": lambda self, *a, **k: None})()
    )
    monkeypatch.setattr(accelerator, "has_accelerator", lambda: True)
    # as torch_npu reports it
    monkeypatch.setattr(accelerator, "is_npu_available", lambda: kind == "npu")
    # (hardware.device_kind)
    monkeypatch.setattr(accelerate.utils, "is_npu_available", lambda *a, **k: kind == "npu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: kind == "cuda")
    facts = hardware.DeviceFacts(
        kind, "NVIDIA H100" if kind == "cuda" else "Ascend910B1", (9, 0) if kind == "cuda" else None
    )
    accelerator.make_accelerator(TrainConfig(), facts)
    names, value, to_set = backend_env.FAILURE_ENV[kind]
    assert {n: seen[n] for n in names} == {n: value if n in to_set else None for n in names}
    other = "npu" if kind == "cuda" else "cuda"
    assert all(seen[n] is None for n in backend_env.FAILURE_ENV[other][0])
    for n in names:  # a value the user set is what the group sees
        os.environ.pop(n, None)
    os.environ[names[-1]] = "1"
    accelerator.make_accelerator(TrainConfig(), facts)
    assert {n: seen[n] for n in names} == {n: "1" if n == names[-1] else None for n in names}


def test_launch_sh_exports_what_the_trainer_sets(hw):
    # (empty is unset, to both; an in-process trainer test may have set them here)
    unset = dict.fromkeys(NAMES, "")
    for kind, devices in (("cuda", {"gpus": 2}), ("npu", {"npus": 8})):
        names, value, to_set = backend_env.FAILURE_ENV[kind]
        env, _, _ = parse(dry_run(unset, bindir=hw(**devices)))
        assert {n: env.get(n) for n in names} == {
            n: value if n in to_set else None for n in names
        }, kind
        for name in names:
            # the user's own value, under any of the names: launch.sh adds none (theirs passes on)
            env, _, _ = parse(dry_run({**unset, name: "1"}, bindir=hw(**devices)))
            assert not set(names) & set(env), (kind, name, env)
    env, _, _ = parse(dry_run(unset))  # a CPU machine: gloo, nothing to set
    assert not {n for names, _, _ in backend_env.FAILURE_ENV.values() for n in names} & set(env)


def test_the_backends_watchdog_monitor_is_on_after_timeout_s_unless_the_user_set_it(hw):
    """TORCH_NCCL_* / TORCH_HCCL_* ENABLE_MONITORING and HEARTBEAT_TIMEOUT_SEC,
    from the trainer and from launch.sh alike (backend_env.MONITOR_ENV); gloo has no such
    monitor."""
    for kind, devices in (("cuda", {"gpus": 2}), ("npu", {"npus": 8})):
        enable, timeout = backend_env.MONITOR_ENV[kind]
        assert accelerator.monitor_env(kind, 120, env := {}) == env == {enable: "1", timeout: "120"}
        assert (
            accelerator.monitor_env(kind, 120, env := {timeout: "900"}) == {enable: "1"}
            and env[timeout] == "900"
        )
        unset = dict.fromkeys(NAMES, "")
        launched, _, _ = parse(dry_run(unset, ["--timeout_s", "120"], bindir=hw(**devices)))
        assert {n: launched.get(n) for n in (enable, timeout)} == {
            enable: "1",
            timeout: "120",
        }, kind
        # theirs passes on
        launched, _, _ = parse(dry_run({**unset, timeout: "900"}, bindir=hw(**devices)))
        assert launched.get(enable) == "1" and timeout not in launched, launched
    assert accelerator.monitor_env("cpu", 120, env := {}) == env == {}
    assert not set(backend_env.MONITOR_ENV["cuda"] + backend_env.MONITOR_ENV["npu"]) & set(
        parse(dry_run(unset))[0]
    )


def test_nccls_own_failure_texts_are_lost_peers():
    # torch 2.15's default "nccl" (nccl2): WorkNCCL::State::setTerminalStatus builds the work's
    # exception, and checkAndAbortIfTimedOutOrError raises at the next collective once the watchdog
    # saw the failure
    assert is_lost_peer(
        DistBackendError("Watchdog caught collective operation timeout: NCCL operation timed out")
    )
    assert is_lost_peer(
        RuntimeError(
            "NCCL operation timed out\nException raised from checkAndAbortIfTimedOutOrError "
            "at /pytorch/torch/csrc/distributed/c10d/nccl2/ProcessGroupNCCLUtils.cpp:322"
        )
    )
    assert is_lost_peer(RuntimeError("NCCL communicator was aborted after a previous error"))
    # the stock ProcessGroupNCCL (TORCH_DIST_USE_NCCL2=0, "nccl-legacy", and torch before 2.15)
    assert is_lost_peer(
        DistBackendError(
            "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=12, "
            "OpType=ALLREDUCE, NumelIn=2797610, NumelOut=2797610, Timeout(ms)=300000) "
            "ran for 300012 milliseconds before timing out."
        )
    )
    # (NCCLUtils.cpp getNcclComm)
    assert is_lost_peer(
        DistBackendError(
            "NCCL communicator was aborted on rank 1. Original reason for failure was: "
            "[PG ID 0 PG GUID 0(default_pg) Rank 1] Process group watchdog thread "
            "terminated with exception: NCCL error: remote process exited or there was a "
            "network error, NCCL version 2.27.3"
        )
    )
    assert not is_lost_peer(
        DistBackendError(
            "NCCL communicator was aborted on rank 1. Original reason for failure "
            "was: CUDA error: an illegal memory access was encountered"
        )
    )
    # any work error, a local CUDA one included
    assert not is_lost_peer(DistBackendError("NCCL operation failed"))
    assert not is_lost_peer(
        RuntimeError("NCCL Async Error: invalid usage (run with NCCL_DEBUG=WARN for details)")
    )


Point = collections.namedtuple("Point", "x y")


def state():
    return {
        "model": collections.OrderedDict(w=torch.arange(6.0).reshape(2, 3), b=torch.ones(2)),
        "optimizer": {
            "state": {0: {"momentum_buffer": torch.full((2, 3), 0.5)}},
            "param_groups": [{"lr": 0.1, "params": [0, 1]}],
        },
        "pair": Point(torch.tensor(3), "x"),
        "steps": (7, [torch.zeros(1, dtype=torch.int64)]),
    }


def assert_same(a, b):
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.device.type == "cpu" and a.dtype == b.dtype and torch.equal(a, b.cpu())
    elif isinstance(a, dict):
        assert list(a) == list(b) and all(assert_same(a[k], b[k]) is None for k in a)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b) and all(assert_same(x, y) is None for x, y in zip(a, b))
    else:
        assert a == b


def test_state_to_host_on_the_cpu_is_a_copy_and_starts_no_stream(monkeypatch):
    monkeypatch.setattr(torch, "Stream", None)  # would raise if one were made
    original = state()
    copied = device_copy.state_to_host(original)
    assert_same(copied, original)
    # training goes on mutating its tensors: the copy keeps the step it was taken at
    original["model"]["w"].add_(1)
    assert (
        copied["model"]["w"][0, 0] == 0 and device_copy.to_host(original["model"]["w"])[0, 0] == 1
    )


class FakeStream:
    """A torch.Stream of an accelerator: records that the copies ran while it was the current
    stream."""

    made, entered = [], []

    def __init__(self, device):
        FakeStream.made.append(device)

    def __enter__(self):
        FakeStream.entered.append(True)

    def __exit__(self, *exc):
        FakeStream.entered.append(False)


def fake_device(monkeypatch, copy_seconds=0.0):
    FakeStream.made, FakeStream.entered = [], []
    queued = []

    def device_to_host(t):  # tensor.to("cpu") on the current stream: here, after a while
        queued.append(FakeStream.entered[-1])
        time.sleep(copy_seconds)
        return t.detach().clone()

    monkeypatch.setattr(torch, "Stream", FakeStream)
    monkeypatch.setattr(device_copy, "_on_host", lambda t: False)  # every tensor is on the device
    monkeypatch.setattr(device_copy, "_device_to_host", device_to_host)
    for module in (torch.accelerator, torch.cuda):  # never a wait on the whole device
        monkeypatch.setattr(
            module, "synchronize", lambda *a: pytest.fail("waited on the whole device")
        )
    return queued


def test_state_to_host_on_a_device_copies_on_one_side_stream(monkeypatch):
    queued = fake_device(monkeypatch)
    original = state()
    copied = device_copy.state_to_host(original)
    assert_same(copied, original)
    # one fresh stream for the device (its tensors share it), not the current one
    assert len(FakeStream.made) == 1
    # every tensor copied while that stream was the current one
    assert len(queued) == 5 and all(queued)
    # and the current stream given back
    assert FakeStream.entered.count(True) == FakeStream.entered.count(False)


def test_a_copy_the_device_never_finishes_is_a_device_copy_timeout(monkeypatch):
    fake_device(monkeypatch, copy_seconds=1.0)
    start = time.monotonic()
    with pytest.raises(device_copy.DeviceCopyTimeout, match="did not finish within 0.05 s"):
        device_copy.state_to_host(state(), timeout_s=0.05)
    # the caller is back at the deadline, the copy still running
    assert time.monotonic() - start < 0.9


def test_a_check_that_reads_an_aborted_all_gather_is_a_lost_peer_not_a_decision(tmp_path):
    """Under TORCH_NCCL_ASYNC_ERROR_HANDLING=2 an all-gather queued behind a hung collective
    returns, once the watchdog aborted the communicator, whatever its output held: a stale row must
    not stop the job as diverged or preempted. Each row carries the step the ranks called the check
    at."""
    from accel_train.errors import LostPeer
    from accel_train.resilience.preempt import AgreedChecks, StopRequest
    from accel_train.training.divergence import NonFiniteWatch

    class Gathered:  # two ranks' rows, the second one stale
        device = torch.device("cpu")

        def __init__(self, stale):
            self.stale = stale

        def gather(self, mine):
            other = mine.clone()
            other[0, 0] = 1  # a stop flag, or a first non-finite step
            other[0, -1] += self.stale
            return torch.cat([mine, other])

    checks = AgreedChecks(StopRequest(), step=0)
    with pytest.raises(LostPeer, match="the agreed check at step 7 read rows of no rank") as raised:
        checks.agree(Gathered(stale=-3), 7)
    assert is_lost_peer(raised.value)
    # rows of this step: the other rank's stop request is acted on
    assert checks.agree(Gathered(stale=0), 7)
    watch = NonFiniteWatch(torch.device("cpu"), tmp_path)
    with pytest.raises(LostPeer, match="the divergence check at step 9"):
        watch.check(Gathered(stale=5), 9)
