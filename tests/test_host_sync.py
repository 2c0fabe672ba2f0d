"""No host sync and no extra collective in a plain training step (issue 14 item 1).

A sitecustomize.py, written into a temp dir put first on PYTHONPATH, wraps the Tensor methods that read
a value on the host (item, __bool__, tolist, cpu, numpy) and torch.distributed's Python collectives (DDP's
gradient all-reduce runs in C++ and is not counted), and counts them per window between two optimizer steps
(a global optimizer step post-hook marks the boundaries). It also records the steps at which the ranks
ran an agreed check (accel_train.preempt.AgreedChecks.agree, where it exists). Every window of a run
without logging or checkpoint steps must then be empty unless it held an agreed check.
"""

import json
import re

from conftest import TINY, clean_env, launch

SITECUSTOMIZE = r'''
import atexit, json, os, sys
_out = os.environ.get("ACCEL_SYNC_LOG")
if _out:
    import torch
    import torch.distributed as dist
    _state = {"step": 0, "syncs": {}, "collectives": {}, "checks": []}

    def _counted(kind, fn):
        def inner(*args, **kwargs):
            # the sampler's index list (torch.randperm(...).tolist()) is made on the host on every device
            if "torch/utils/data/" not in sys._getframe(1).f_code.co_filename:
                key = str(_state["step"])
                _state[kind][key] = _state[kind].get(key, 0) + 1
            return fn(*args, **kwargs)
        return inner

    for _name in ("item", "__bool__", "tolist", "cpu", "numpy"):
        setattr(torch.Tensor, _name, _counted("syncs", getattr(torch.Tensor, _name)))
    for _name in ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
                  "broadcast_object_list", "gather", "reduce", "barrier", "all_to_all"):
        if hasattr(dist, _name):
            setattr(dist, _name, _counted("collectives", getattr(dist, _name)))

    def _on_step(optimizer, args, kwargs):
        _state["step"] += 1
        if _state["step"] == 1:  # the trainer is imported by now: note where it runs its agreed checks
            checks = getattr(sys.modules.get("accel_train.preempt"), "AgreedChecks", None)
            if checks is not None:
                agree = checks.agree
                def recorded(self, accelerator, step, *a, **k):
                    if a or k:  # the training loop's checks pass the non-finite watch; evaluation's do not
                        _state["checks"].append(_state["step"])
                    return agree(self, accelerator, step, *a, **k)
                checks.agree = recorded

    from torch.optim.optimizer import register_optimizer_step_post_hook
    register_optimizer_step_post_hook(_on_step)

    def _write():
        if _state["step"]:
            with open(f"{_out}.{os.environ.get('RANK', '0')}", "w") as f:
                json.dump(_state, f)
    atexit.register(_write)
'''


def test_plain_steps_make_no_host_sync_and_no_collective_on_2_ranks(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    log = tmp_path / "syncs"
    env = clean_env(ACCEL_SYNC_LOG=str(log))
    env["PYTHONPATH"] = f"{site}:{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(site)
    steps = 30  # 2 ranks x batch 4: 240 samples are 30 steps; no log step, no step checkpoint
    proc = launch("2proc_cpu.yaml", [*TINY, "--train_samples", str(8 * steps), "--test_samples", "8",
                                     "--batch_size", "4",
                                     "--epochs", "1", "--log_every", "1000", "--output_dir", tmp_path / "out"],
                  env=env, timeout=300)
    assert re.search(r"step 30\b", proc.stderr + proc.stdout)
    ranks = [json.loads((tmp_path / f"syncs.{r}").read_text()) for r in (0, 1)]
    for rank, rec in enumerate(ranks):
        assert rec["step"] == steps, rec
        checks = set(rec["checks"])
        # window k: after optimizer step k, before step k+1 (window 0 is start-up; the last one holds the
        # epoch end's evaluation and checkpoint)
        for kind in ("syncs", "collectives"):
            stray = {int(k): n for k, n in rec[kind].items() if 0 < int(k) < steps and int(k) not in checks}
            assert not stray, f"rank {rank}: {kind} in steps without an agreed check (step: count): {stray}; " \
                              f"agreed checks at {sorted(checks)}"
        # checks every few seconds of work: far fewer than steps (a slow machine checks more often)
        assert 1 <= len(checks) <= steps // 3, sorted(checks)
    assert ranks[0]["checks"] == ranks[1]["checks"]  # every rank checks at the same steps


def test_agreed_check_interval_is_about_2s_of_work_at_most_5s_and_costs_at_most_1_percent():
    from accel_train.preempt import AgreedChecks
    assert AgreedChecks.interval(0.01, 0.0) == 200  # 2 s of 10 ms steps
    assert AgreedChecks.interval(0.001, 0.04) == 4000  # a 40 ms check: 100x its cost apart (4 s)
    assert AgreedChecks.interval(0.001, 1.0) == 5000  # never more than 5 s of work between checks
    assert AgreedChecks.interval(3.0, 0.0) == 1 and AgreedChecks.interval(30.0, 0.0) == 1  # long steps: each one
