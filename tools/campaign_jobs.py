"""How the fault campaign starts a job (tools/campaign.py) on each layout, and watches one run of
it: the faults at their events, every process of the job, the steps it logs, each attempt's exit
status."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from campaign_draw import LAYOUTS, Scenario  # noqa: E402
from campaign_procs import (  # noqa: E402
    NODE_ENV,
    TAG_ENV,
    Watch,
    inject,
    job_procs,
    ranks,
    victims,
    writers,
)
from conftest import TwoHosts, clean_env  # noqa: E402 (the suite's hosts and clean environment)

SCRIPT = "examples/train_own_data.py"
ATTEMPT_TIMEOUT = 420


@dataclass
class Layout:
    """Where and how a job runs: processes per machine, machines (two network hosts: `hosts`), its
    launcher."""

    per: int
    machines: int
    how: str
    hosts: TwoHosts | None = None

    @classmethod
    def of(cls, scn: Scenario, hosts, per: int | None = None):
        p, m, how = LAYOUTS[scn.layout]
        return cls(per or p, m, how, hosts if m > 1 else None)

    def outs(self, base: Path) -> list[Path]:
        return [base / f"node{n}" for n in range(self.machines)] if self.machines > 1 else [base]

    def start(
        self, scn: Scenario, args: list, base: Path, logs: list[Path], tag: str, hooks: str = ""
    ) -> list[subprocess.Popen]:
        """hooks: a folder put first on every process's PYTHONPATH (tests/test_campaign.py plants
        bugs with a sitecustomize.py there)."""
        procs, port = [], str(random.randint(20000, 40000))
        for node, out in enumerate(self.outs(base)):
            env = {
                TAG_ENV: tag,
                NODE_ENV: str(node),
                "ACCEL_RESTART_DELAY": "1",
                "NPROC_PER_NODE": str(self.per),
                "PYTHONPATH": os.pathsep.join(
                    filter(None, [hooks, str(ROOT / "tests"), str(ROOT)])
                ),
            }
            if scn.model == "script":
                env["ACCEL_TRAIN_SCRIPT"] = SCRIPT
            full = [*map(str, args), "--output_dir", str(out)]
            if self.how == "accelerate":
                entry = [SCRIPT] if scn.model == "script" else ["-m", "accel_train"]
                cmd = [
                    sys.executable,
                    "-m",
                    "accelerate.commands.launch",
                    "--config_file",
                    str(
                        ROOT
                        / "accelerate_configs"
                        / ("2proc_cpu.yaml" if self.per == 2 else "cpu.yaml")
                    ),
                    *entry,
                    *full,
                ]
            else:
                cmd = ["bash", str(ROOT / "launch.sh"), "--max_restarts", "2", *full]
            if self.hosts is not None:
                env.update(
                    NNODES=str(self.machines),
                    NODE_RANK=str(node),
                    MASTER_ADDR=self.hosts.ip[0],
                    MASTER_PORT=port,
                )
                procs.append(self.hosts.popen(node, cmd, self.hosts.env(node, **env), logs[node]))
            else:
                with open(logs[node], "w") as f:
                    procs.append(
                        subprocess.Popen(
                            cmd,
                            stdout=f,
                            stderr=subprocess.STDOUT,
                            env=clean_env(**env),
                            cwd=ROOT,
                            start_new_session=True,
                        )
                    )
        return procs


def wait_codes(procs: list[subprocess.Popen], tag: str, timeout: float) -> list[int] | None:
    """Every process's status; None (and the whole job killed) past the timeout."""
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            stop_job(procs, tag)
            return None
    return [p.returncode for p in procs]


def stop_job(procs: list[subprocess.Popen], tag: str) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in job_procs(tag):
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in procs:
        p.wait()


@dataclass
class Observed:
    """What the campaign saw of one faulted job, over all its attempts."""

    faults: list = field(default_factory=list)  # one dict per fault injected
    codes: list = field(default_factory=list)  # each attempt's statuses (one per machine)
    # (time, last step logged) at each change of steps.jsonl
    timeline: list = field(default_factory=list)
    new_ranks: list = field(default_factory=list)  # (time, pid) of each rank process first seen
    two_writers: list = field(default_factory=list)  # machines seen with two writers at once
    stopped: list = field(default_factory=list)  # pids a SIGSTOP hit
    workers: set = field(default_factory=set)  # DataLoader workers seen (job_procs)
    timed_out: bool = False


def watch_attempt(
    procs,
    scn: Scenario,
    layout: Layout,
    out0: Path,
    logs: list[Path],
    tag: str,
    plan: list,
    seen: Observed,
    total: int,
    steps_per_epoch: int,
) -> list[int] | None:
    """Poll until the attempt's launchers end: inject each planned fault when its event comes (in
    order; a later one only after the earlier one's relaunch logged a step), record the steps logged
    and the processes.
    """
    watch, known, start = Watch(out0), {p.pid for p in ranks(job_procs(tag))}, time.monotonic()
    started_steps, last_scan, last_token, procs_seen = watch.last_step()[0], 0.0, None, False
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if now - start > ATTEMPT_TIMEOUT:
            seen.timed_out = True
            stop_job(procs, tag)
            return None
        step, token = watch.last_step()
        if token != last_token:
            seen.timeline.append((now, step))
            last_token = token
        if now - last_scan > 0.25:
            last_scan, found = now, job_procs(tag, seen.workers)
            seen.two_writers += writers(found)
            for p in ranks(found):
                if p.pid not in known:
                    known.add(p.pid)
                    seen.new_ranks.append((now, p.pid))
            procs_seen = procs_seen or bool(ranks(found))
        if plan and ready(plan[0], seen, watch, steps_per_epoch, total, started_steps, procs_seen):
            fire(plan.pop(0), scn, layout, seen, tag, logs, step, total)
        time.sleep(0.005)
    return [p.returncode for p in procs]


def ready(
    f: dict,
    seen: Observed,
    watch: Watch,
    steps_per_epoch: int,
    total: int,
    started: int,
    procs: bool,
) -> bool:
    if seen.faults:  # a second fault: once the first one's relaunch has logged a new step
        before = seen.faults[-1]
        if not any(
            t > before["t"] and pid not in before["pids_before"] for t, pid in seen.new_ranks
        ):
            return False
        if (
            not any(t > max(t for t, _ in seen.new_ranks) for t, _ in seen.timeline)
            and f["event"] != "survivor"
        ):
            return False
    at = max(1, min(total - 1, round(f["at"] * total)))
    return watch.event(f["event"], steps_per_epoch, at, started, procs)


def fire(
    f: dict,
    scn: Scenario,
    layout: Layout,
    seen: Observed,
    tag: str,
    logs: list[Path],
    step: int,
    total: int,
) -> None:
    found = job_procs(tag, seen.workers)
    pids = victims(f["fault"], found, f["node"], f["rank"])
    inject(f["fault"], pids)
    if f["fault"] == "stop_rank":
        seen.stopped += pids
    per_machine = layout.per > 1
    # the step the job had logged (None: nothing yet since the job started, e.g. a fault at
    # start-up)
    logged = (
        step if any(s != seen.timeline[0][1] for _, s in seen.timeline) or len(seen.codes) else None
    )
    seen.faults.append(
        {
            **f,
            "t": time.monotonic(),
            "pids": pids,
            "step_at_fault": logged,
            "late": step >= total,
            "pids_before": {p.pid for p in ranks(found)},
            "attempt": len(seen.codes),
            "log_offset": logs[0].stat().st_size if logs[0].exists() else 0,
            "survivor_possible": (
                (per_machine and f["fault"] in ("kill_rank", "stop_rank"))
                or layout.machines > 1
                and f["fault"] in ("kill_rank", "kill_machine", "stop_rank")
            ),
        }
    )
