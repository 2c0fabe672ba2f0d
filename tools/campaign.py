"""Fault campaign: scenarios drawn from a seed, each run for real and checked against its reference.

Draws scenarios (layout x flags x starting point x faults at a step or a named event), runs each for
real, and checks it against the uninterrupted run of the same flags (tools/campaign_check.py). A
failing scenario prints its seed and the one command that replays it.

    python tools/campaign.py --seed 1 --minutes 60 --log /tmp/c.jsonl   # scenarios until time is up
    python tools/campaign.py --seed 1 --scenarios 3                    # three of them
    python tools/campaign.py --scenario_seed 123456                    # replay one scenario
    python tools/campaign.py --summary /tmp/c.jsonl    # counts, failures, recovery times

Drawn (tools/campaign_draw.py): layout (launch.sh with 1 or 2 ranks and --max_restarts 2, accelerate
launch with 2 ranks and a platform-style rerun with --resume auto, two network hosts running
launch.sh); model (timm's test ResNet with BatchNorm or GroupNorm, an own --model module:fn, a
train() script with its own Dataset); data (random, an image folder) and --pipeline
device/cpu/cache; --grad_accum 1/2, --ema, --clip_grad, --channels_last,
--mixed_precision no/bf16, --checkpoint_every 2/3/5; start (fresh, --resume auto, --resume PATH of
an older step,
--overwrite over another run, elastic resume from the other process count); one or two faults
(SIGKILL of a rank, of every rank of a machine, of accelerate launch, of launch.sh; SIGSTOP of a
rank with --timeout_s 20; SIGTERM, SIGUSR1, SIGINT) at a step or at start-up, a checkpoint write,
the evaluation, an epoch's row, a survivor's save. The whole campaign needs root only for the
two-host layout (left out without it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from campaign_check import (  # noqa: E402
    check_faults,
    check_processes,
    check_statuses,
    compare_outputs,
)
from campaign_draw import LAYOUTS, Scenario, draw, reference_key, trainer_flags  # noqa: E402
from campaign_jobs import (  # noqa: E402
    Layout,
    Observed,
    TwoHosts,
    stop_job,
    wait_codes,
    watch_attempt,
)
from campaign_procs import SIGNALS, kill_all, resume_all, rows, wait_gone  # noqa: E402


class Campaign:
    def __init__(self, workdir: Path, log: Path | None, hooks: str = ""):
        self.workdir, self.log, self.hosts, self.hooks, self.tags = (
            Path(workdir),
            log,
            None,
            hooks,
            [],
        )
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.can_hosts = os.geteuid() == 0 and shutil.which("ip") is not None

    def close(self):
        """The job under way (a campaign stopped by a signal) and the network namespaces go."""
        for tag in self.tags:
            kill_all(tag)
        if self.hosts is not None:
            self.hosts.down()

    def layout(self, scn: Scenario, per: int | None = None) -> Layout:
        if LAYOUTS[scn.layout][1] > 1 and self.hosts is None:
            self.hosts = TwoHosts(str(90 + os.getpid() % 10))
            self.hosts.down()
            self.hosts.up()
        return Layout.of(scn, self.hosts, per)

    def new_tag(self) -> str:
        self.tags = [uuid.uuid4().hex]
        return self.tags[0]

    def images(self) -> Path:
        """An image folder of two classes (64 + 8 PNGs each, 16 px), written once per campaign."""
        root = self.workdir / "images"
        if not (root / "val").is_dir():
            import numpy as np
            from PIL import Image

            rng = np.random.default_rng(0)
            for split, n in (("train", 64), ("val", 8)):
                for c in ("cat", "dog"):
                    (root / split / c).mkdir(parents=True, exist_ok=True)
                    for i in range(n):
                        Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(
                            root / split / c / f"{i:03d}.png"
                        )
        return root

    def flags(self, scn: Scenario, ranks: int | None = None) -> list[str]:
        extra = (
            ["--data_dir", str(self.images())]
            if scn.data == "imagefolder" and scn.model != "script"
            else []
        )
        return [*trainer_flags(scn, ranks), *extra]

    def plain(
        self, scn: Scenario, args: list, base: Path, name: str, per: int | None = None
    ) -> tuple[int, str]:
        """A run without faults (the reference, a starting point): its worst status and rank 0's
        log."""
        layout, tag = self.layout(scn, per), self.new_tag()
        logs = [base.parent / f"{name}-node{n}.log" for n in range(layout.machines)]
        codes = wait_codes(layout.start(scn, args, base, logs, tag, self.hooks), tag, 420)
        return (max(codes, key=abs) if codes else -1), logs[0].read_text()

    def reference(self, scn: Scenario) -> tuple[Path | None, str]:
        ref = self.workdir / "refs" / reference_key(scn) / "out"
        done = ref.parent / "done"
        if not done.exists():
            shutil.rmtree(ref.parent, ignore_errors=True)
            ref.parent.mkdir(parents=True)
            code, text = self.plain(scn, self.flags(scn), ref, "ref")
            done.write_text(str(code))
            if code != 0:
                (ref.parent / "refused").write_text(text[-3000:])
        if done.read_text() != "0":
            return None, (ref.parent / "refused").read_text()
        return Layout.of(scn, None).outs(ref)[0], ""

    def prepare(self, scn: Scenario, base: Path, total: int) -> list[str]:
        """The starting point: a run already in --output_dir (or elsewhere) and the flags that
        continue it."""
        flags, cut = self.flags(scn), str(max(2, round(total * 0.4)))  # (mid-epoch: 2 epochs)
        if scn.start == "fresh":
            return []
        if scn.start == "elastic":
            other = 1 if scn.ranks > 1 else 2
            code, text = self.plain(
                scn,
                [*self.flags(scn, other), "--max_steps", cut],
                base,
                "prefix",
                per=other if LAYOUTS[scn.layout][1] == 1 else None,
            )
            return ["--resume", "auto"]
        extra = {"overwrite": ["--seed", "7"]}.get(scn.start, [])
        code, text = self.plain(scn, [*flags, "--max_steps", cut, *extra], base, "prefix")
        if code != 0:
            raise RuntimeError(f"the starting run failed ({code}): {text[-2000:]}")
        if scn.start == "resume_auto":
            return ["--resume", "auto"]
        if scn.start == "overwrite":
            return ["--overwrite", "true"]
        out0 = Layout.of(scn, None).outs(base)[0]
        older = sorted((out0 / "checkpoints").glob("step_*"))[0]
        return ["--resume", str(older)]

    def run(self, scn: Scenario) -> dict:
        t0, work = time.monotonic(), self.workdir / "runs" / str(scn.seed)
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        result = {
            "seed": scn.seed,
            "scenario": scn.to_json(),
            "describe": scn.describe(),
            "fails": [],
        }
        ref, refused = self.reference(scn)
        if ref is None:
            said = [line for line in refused.splitlines() if "error:" in line] or [
                "(no error line)"
            ]
            result.update(skipped=f"the uninterrupted run refused these flags: {said[0]}")
            return result
        ref_rows = rows(ref / "steps.jsonl")
        total, per_epoch = ref_rows[-1]["step"], rows(ref / "metrics.jsonl")[0]["step"]
        base = work / "out"
        start = self.prepare(scn, base, total)
        layout, tag = self.layout(scn), self.new_tag()
        timeout = [
            "--timeout_s",
            "20" if any(f["fault"] == "stop_rank" for f in scn.faults) else "60",
        ]
        args = [*self.flags(scn), *start, *timeout]
        seen, plan, allowed = Observed(), [dict(f) for f in scn.faults], []
        out0, attempt = layout.outs(base)[0], 0
        while True:
            logs = [work / f"attempt{attempt}-node{n}.log" for n in range(layout.machines)]
            procs = layout.start(scn, args, base, logs, tag, self.hooks)
            codes = watch_attempt(procs, scn, layout, out0, logs, tag, plan, seen, total, per_epoch)
            seen.codes.append(codes)
            allowed.append(documented(scn, layout, seen, attempt))
            resume_all(seen.stopped)
            # what may still run once the launchers ended: a killed rank's DataLoader workers (they
            # see their parent gone within 5 s); after launch.sh was killed, the whole job it left
            # (ends by itself)
            left = wait_gone(
                tag, 150 if any(f["fault"] == "kill_launch_sh" for f in seen.faults) else 15
            )
            if left:
                stop_job([], tag)
            # (the last step's row and a model file are not enough: a --resume auto start's model
            # file is its prefix run's, and a stop during the last evaluation leaves the last step's
            # row)
            finished = (
                [r["step"] for r in rows(out0 / "steps.jsonl")[-1:]] == [total]
                and (out0 / "model.safetensors").exists()
                and FINISHED.search(logs[0].read_text(errors="replace"))
            )
            if (
                codes is None
                or attempt >= 2
                or (all(c == 0 for c in codes) or plan == [] and finished)
            ):
                break
            attempt += 1  # the platform starts the job again: --resume auto continues the run ...
            if seen.timeline and any(s != seen.timeline[0][1] for _, s in seen.timeline):
                args = [
                    *strip_resume([a for a in args if a not in ("--overwrite", "true")]),
                    "--resume",
                    "auto",
                ]
            # ... or, where it never logged a step, the same command again (an --overwrite job that
            # died before it set the other run aside: --resume auto would continue that other run
            # and is refused)
        result.update(
            timed_out=seen.timed_out, codes=seen.codes, seconds=round(time.monotonic() - t0, 1)
        )
        logs = [p.read_bytes() for p in sorted(work.glob("attempt*-node0.log"))]
        result["faults"] = [measure(f, seen, logs) for f in seen.faults]
        text = b"".join(logs).decode(errors="replace")
        fails = ["timed out"] if seen.timed_out else []
        fails += check_processes(left, seen.two_writers)
        fails += check_statuses(
            [c for codes in seen.codes if codes for c in codes],
            [a for codes, a in zip(seen.codes, allowed) if codes for _ in codes],
        )
        fails += check_faults(result["faults"], scn.checkpoint_every)
        rowless = tuple(
            int(e)
            for e in re.findall(r"epoch (\d+)'s training numbers are not in the checkpoint", text)
        )
        partial = tuple(
            int(e) for e, b in PARTIAL.findall(text) if 0 < int(b) < per_epoch * scn.grad_accum
        )
        result["partial_epochs"] = (
            partial  # (a known difference: campaign_check.PARTIAL_EPOCH_COLUMNS)
        )
        fails += compare_outputs(
            out0,
            ref,
            elastic=scn.start == "elastic",
            rowless=rowless,
            partial=partial,
            survivor="saved by the survivor" in text,
            sixteen_bit=scn.mixed_precision != "no",
        )
        result["fails"] = fails
        if not seen.faults:
            result["note"] = "no fault injected: the run ended before its event"
        return result


def strip_resume(args: list) -> list:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == "--resume":
            skip = True
        else:
            out.append(a)
    return out


def documented(scn: Scenario, layout: Layout, seen: Observed, attempt: int) -> set:
    """Exit statuses docs/failures.md documents for this attempt's launcher after the faults
    injected in it (Exit statuses): launch.sh relaunches a lost peer or a killed rank and passes a
    preemption on as 4; accelerate launch says 1 for any failed worker; a launcher killed by the
    campaign ends by that signal."""
    mine = [f for f in seen.faults if f["attempt"] == attempt]
    ok = {0}
    for f in mine:
        if (
            f["fault"] in ("kill_launch_sh",)
            or f["fault"] == "kill_launcher"
            and layout.how == "accelerate"
        ):
            ok.add(-9)
        if layout.how == "accelerate":
            # 1 for a failed worker; the launcher itself ended by the signal sent to it, or
            # (accelerate >= 1.15, commands/launch.py) 128 + N once its agent stopped the workers
            ok |= (
                {1, -SIGNALS[f["fault"]], 128 + SIGNALS[f["fault"]]}
                if f["fault"] in SIGNALS
                else {1}
            )
        elif f["fault"] in (
            "term",
            "usr1",
            "int",
        ):
            # preempted (4), or finished before the stop was agreed (0)
            ok = {4, 0}
    return ok


# rank 0's last line (outputs.py), once every output is written
FINISHED = re.compile(r"\] done in \d")
RESUMED = re.compile(r"resumed from (\S+): epoch \d+, step (\d+)")
PARTIAL = re.compile(r"resumed from \S+: epoch (\d+), step \d+, (\d+) batches into the epoch")


def measure(f: dict, seen: Observed, logs: list[bytes]) -> dict:
    """Steps lost (the last step logged when it hit - the step the next start resumed from) and
    recovery time (the fault to the first step a new rank process logged). logs: machine 0's log of
    each attempt; a resume counts from the fault's moment in its attempt's log on (log_offset:
    bytes)."""
    # the rest of the fault's attempt counts from launch.sh's relaunch on (a killed simple
    # launcher's traceback replays the trainer's earlier lines, its 'resumed from' too), else the
    # next attempt's log
    rest = logs[f["attempt"]][f["log_offset"] :]
    cut = rest.find(b"launch.sh: machine ")
    after = ((rest[cut:] if cut >= 0 else b"") + b"".join(logs[f["attempt"] + 1 :])).decode(
        errors="replace"
    )
    later = RESUMED.findall(after)
    resumed = int(later[0][1]) if later else None
    new = [t for t, pid in seen.new_ranks if t > f["t"] and pid not in f["pids_before"]]
    recovery = None
    if new and resumed is not None:
        recovery = next(
            (round(t - f["t"], 2) for t, s in seen.timeline if t > new[0] and s > resumed), None
        )
    lost = (
        max(0, f["step_at_fault"] - resumed)
        if resumed is not None and f["step_at_fault"] is not None
        else None
    )
    keep = ("fault", "event", "at", "rank", "node", "step_at_fault", "late", "survivor_possible")
    return {**{k: f[k] for k in keep}, "resumed": resumed, "lost": lost, "recovery_s": recovery}


def replay_command(seed: int) -> str:
    return f"python tools/campaign.py --scenario_seed {seed}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--seed", type=int, default=0, help="the campaign's seed: it draws every scenario's seed"
    )
    p.add_argument(
        "--minutes", type=float, default=None, help="draw scenarios until this much time has passed"
    )
    p.add_argument("--scenarios", type=int, default=None, help="at most this many scenarios")
    p.add_argument(
        "--scenario_seed", type=int, nargs="*", default=None, help="run these scenarios (a replay)"
    )
    p.add_argument(
        "--workdir", default="/tmp/accel_campaign", help="references, runs and data (kept)"
    )
    p.add_argument("--log", default=None, help="append one JSON line per scenario here")
    p.add_argument("--summary", default=None, help="summarise a campaign log and exit")
    a = p.parse_args(argv)
    if a.summary:
        from campaign_summary import summarise

        print(summarise(Path(a.summary)))
        return 0
    campaign = Campaign(Path(a.workdir), Path(a.log) if a.log else None)
    # (through `finally`: the job and namespaces go)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # A campaign started in the background of a script inherits SIGINT ignored, and so would every
    # job it starts: a shell cannot trap a signal ignored at its start, so launch.sh would never see
    # the Ctrl-C faults. Handled here, it is the default again in each job (an exec resets handled
    # signals, not ignored ones)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    rng, t0, n, failed = random.Random(a.seed), time.monotonic(), 0, []
    seeds = (
        iter(a.scenario_seed) if a.scenario_seed else iter(lambda: rng.randrange(1, 2**31), None)
    )
    try:
        for seed in seeds:
            if (
                a.scenarios is not None
                and n >= a.scenarios
                or a.minutes
                and time.monotonic() - t0 > a.minutes * 60
            ):
                break
            scn, n = draw(seed, campaign.can_hosts), n + 1
            try:
                result = campaign.run(scn)
            except Exception as e:  # the runner's own failure: said, and the campaign goes on
                result = {
                    "seed": seed,
                    "describe": scn.describe(),
                    "fails": [f"campaign error: {e!r}"[:500]],
                }
            verdict = "SKIP" if result.get("skipped") else "FAIL" if result["fails"] else "ok"
            print(
                f"[{n}] {verdict} seed {seed}: {scn.describe()} ({result.get('seconds', '?')} s)",
                flush=True,
            )
            for line in result["fails"] + ([result["skipped"]] if result.get("skipped") else []):
                print(f"    {line}", flush=True)
            if result["fails"]:
                failed.append(seed)
                print(f"    replay: {replay_command(seed)}", flush=True)
            if campaign.log:
                with open(campaign.log, "a") as f:
                    f.write(json.dumps(result, default=str) + "\n")
    finally:
        campaign.close()
    print(
        f"{n} scenario(s), {len(failed)} failed" + (f": seeds {failed}" if failed else ""),
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
