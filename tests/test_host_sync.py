"""No host sync and no extra collective in a plain training step.

A sitecustomize.py, written into a temp dir put first on PYTHONPATH, wraps what reads a device value
on the host (Tensor.item, __bool__, __float__, __int__, __index__, __complex__, tolist, cpu, numpy,
a `.to(...)` whose destination is the CPU, torch.equal / torch.allclose / torch.is_nonzero and their
Tensor methods) and torch.distributed's Python collectives (DDP's gradient all-reduce runs in C++
and is not counted), and counts them per window between two optimizer steps (a global optimizer step
post-hook marks the boundaries). It also records the steps at which the ranks ran an agreed check
(accel_train.resilience.preempt.AgreedChecks.agree, where it exists). Every window of a run without
logging or checkpoint steps must then be empty unless it held an agreed check.

The agreed checks' clock is the step count: AgreedChecks reads time.perf_counter,
which the hook replaces, in accel_train.resilience.preempt only, by a clock that advances exactly
STEP_S per optimizer step. The checks then fall at steps 1 and 21 of 30 by construction (step 1,
then TARGET_S / STEP_S = 20 steps later) on any machine, however loaded; with the real clock a step
over ~0.67 s on a busy machine made a check every step or two.
"""

import json
import re

from conftest import TINY, clean_env, launch

# seconds of work per step, as the agreed checks see it: checks at steps 1 and 1 + 2.0 / 0.1
STEP_S = 0.1
SITECUSTOMIZE = r"""
import atexit, json, os, sys
STEP_S = {STEP_S!r}
_out = os.environ.get("ACCEL_SYNC_LOG")
if _out:
    import torch
    import torch.distributed as dist
    _state = {"step": 0, "syncs": {}, "collectives": {}, "checks": []}

    def _counted(kind, fn):
        def inner(*args, **kwargs):
            # the sampler's index list (torch.randperm(...).tolist()) is made on the host on every
            # device
            if "torch/utils/data/" not in sys._getframe(1).f_code.co_filename:
                key = str(_state["step"])
                _state[kind][key] = _state[kind].get(key, 0) + 1
            return fn(*args, **kwargs)
        return inner

    for _name in ("item", "__bool__", "__float__", "__int__", "__index__", "__complex__", "tolist",
                  "cpu", "numpy", "equal", "allclose", "is_nonzero"):
        setattr(torch.Tensor, _name, _counted("syncs", getattr(torch.Tensor, _name)))
    for _name in ("equal", "allclose", "is_nonzero"):
        setattr(torch, _name, _counted("syncs", getattr(torch, _name)))

    # t.to("cpu"), t.to(torch.device("cpu")), t.to(device="cpu"), t.to(other_cpu_tensor)
    def _to_host(args, kwargs):
        where = kwargs.get("device", args[0] if args else None)
        if isinstance(where, torch.Tensor):
            where = where.device
        try:
            return (where is not None and not isinstance(where, torch.dtype)
                    and torch.device(where).type == "cpu")
        except (TypeError, RuntimeError):
            return False

    _to, _NOT_SYNCS = torch.Tensor.to, ("torch/utils/data/", "accelerate/utils/operations.py")

    def _to_maybe_counted(self, *args, **kwargs):
        # (accelerate/utils/operations.py: send_to_device moves each batch to the run's device, a
        # host-to-device copy on an accelerator)
        caller = sys._getframe(1).f_code.co_filename
        if _to_host(args, kwargs) and not any(p in caller for p in _NOT_SYNCS):
            key = str(_state["step"])
            _state["syncs"][key] = _state["syncs"].get(key, 0) + 1
        return _to(self, *args, **kwargs)
    torch.Tensor.to = _to_maybe_counted
    for _name in ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
                  "broadcast", "broadcast_object_list", "gather", "reduce", "barrier",
                  "all_to_all"):
        if hasattr(dist, _name):
            setattr(dist, _name, _counted("collectives", getattr(dist, _name)))

    def _on_step(optimizer, args, kwargs):
        _state["step"] += 1
        # the trainer is imported by now: note where it runs its agreed checks
        if _state["step"] == 1:
            preempt = sys.modules.get("accel_train.resilience.preempt")
            checks = getattr(preempt, "AgreedChecks", None)
            if checks is not None:
                agree = checks.agree
                def recorded(self, accelerator, step, *a, **k):
                    # the training loop's checks pass the non-finite watch; evaluation's do not
                    if a or k:
                        _state["checks"].append(_state["step"])
                    return agree(self, accelerator, step, *a, **k)
                checks.agree = recorded

    # the agreed checks' clock: STEP_S per optimizer step (accel_train.resilience.preempt's `time`
    # only)
    import time as _time
    import accel_train.resilience.preempt as _preempt

    class _StepClock:
        def perf_counter(self):
            return _state["step"] * STEP_S

        def __getattr__(self, name):
            return getattr(_time, name)
    _preempt.time = _StepClock()

    from torch.optim.optimizer import register_optimizer_step_post_hook
    register_optimizer_step_post_hook(_on_step)

    def _write():
        if _state["step"]:
            with open(f"{_out}.{os.environ.get('RANK', '0')}", "w") as f:
                json.dump(_state, f)
    atexit.register(_write)
""".replace("{STEP_S!r}", repr(STEP_S))


def test_plain_steps_make_no_host_sync_and_no_collective_on_2_ranks(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    log = tmp_path / "syncs"
    env = clean_env(ACCEL_SYNC_LOG=str(log))
    env["PYTHONPATH"] = f"{site}:{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(site)
    steps = 30  # 2 ranks x batch 4: 240 samples are 30 steps; no log step, no step checkpoint
    proc = launch(
        "2proc_cpu.yaml",
        [
            *TINY,
            "--train_samples",
            str(8 * steps),
            "--test_samples",
            "8",
            "--batch_size",
            "4",
            "--epochs",
            "1",
            "--log_every",
            "1000",
            "--output_dir",
            tmp_path / "out",
        ],
        env=env,
        timeout=300,
    )
    assert re.search(r"step 30\b", proc.stderr + proc.stdout)
    ranks = [json.loads((tmp_path / f"syncs.{r}").read_text()) for r in (0, 1)]
    for rank, rec in enumerate(ranks):
        assert rec["step"] == steps, rec
        checks = set(rec["checks"])
        # window k: after optimizer step k, before step k+1 (window 0 is start-up; the last one
        # holds the epoch end's evaluation and checkpoint)
        for kind in ("syncs", "collectives"):
            stray = {
                int(k): n
                for k, n in rec[kind].items()
                if 0 < int(k) < steps and int(k) not in checks
            }
            assert not stray, (
                f"rank {rank}: {kind} in steps without an agreed check (step: count): {stray}; "
                f"agreed checks at {sorted(checks)}"
            )
        # a check at step 1 (its time then known), the next one TARGET_S of (step-clock) work later:
        # step 21
        assert rec["checks"] == [1, 21], rec["checks"]
    assert ranks[0]["checks"] == ranks[1]["checks"]  # every rank checks at the same steps


def test_agreed_check_interval_is_about_2s_of_work_at_most_5s_and_costs_at_most_1_percent():
    from accel_train.resilience.preempt import AgreedChecks

    assert AgreedChecks.interval(0.01, 0.0) == 200  # 2 s of 10 ms steps
    assert AgreedChecks.interval(0.001, 0.04) == 4000  # a 40 ms check: 100x its cost apart (4 s)
    assert AgreedChecks.interval(0.001, 1.0) == 5000  # never more than 5 s of work between checks
    # long steps: each one
    assert AgreedChecks.interval(3.0, 0.0) == 1 and AgreedChecks.interval(30.0, 0.0) == 1
