"""The relaunch policy (accel_train/launcher/policy.py), in process: what the ranks reported ->
relaunch or exit, with which status and line, for every status and the mixes the fault campaign met.
"""

import pytest

from accel_train import errors
from accel_train.launcher import policy
from accel_train.launcher.policy import Report, decide
from accel_train.rank_files import TERM_NOTE

CLEAN_NOTE = "backend: gloo\nexit: python\n"  # a rank's note that did not abort
ABORT = "Fatal Python error: Aborted\n\nCurrent thread ...\n"


def report(*written, notes=None) -> Report:
    """A Report of ranks host-0.. that wrote `written`, plus fault notes (by name)."""
    statuses = {f"host-{i}": f"{code}\n" for i, code in enumerate(written)}
    notes = {"host-8": CLEAN_NOTE, **(notes or {})}
    return Report(statuses=statuses, notes=notes, anything=bool(statuses or notes))


# a note that ends without Python's exit, and no status file of that rank
KILLED = {"host-7": "backend: gloo\n"}


@pytest.mark.parametrize(
    "written,notes,expected",
    [
        ([4, 4], {}, 4),  # every rank preempted
        ([4, 2], {}, 2),  # bad input on one rank wins over the others' preemption
        ([1, 5], {}, 5),  # diverged: not relaunched, whatever the others say
        ([4], {"host-9": ABORT}, 3),  # a rank aborted by the NCCL watchdog: a lost peer
        ([4], {"host-9": "backend: nccl\n" + ABORT}, 3),  # (its note names its backend)
        ([2], {"host-9": ABORT}, 2),  # ... unless a rank found bad input
        # gloo aborts on a collective mismatch, a bug
        (
            [3],
            {"host-9": "backend: gloo\n" + ABORT},
            1,
        ),
        ([2], {"host-9": "backend: gloo\n" + ABORT}, 2),
        ([130, 4], {}, 130),  # a second Ctrl-C beats the preemption it interrupted
        ([3, 4], {}, 4),
        ([3, 2], {}, 2),  # bad input beside a lost peer
        ([], {}, None),  # nothing written at all: the launcher's status decides
        ([], KILLED, 137),  # a rank killed outright: its note alone, no exit, no status
        ([3], KILLED, 3),  # ... and a survivor that saved the step: a lost peer
        ([1], KILLED, 1),  # (an error elsewhere is an error)
        ([0, 0], {}, None),  # (success is no failure status)
    ],
)
def test_trainer_status_picks_the_most_telling_status(written, notes, expected):
    assert policy.trainer_status(report(*written, notes=notes)) == expected


def test_the_priority_is_errors_py_list():
    """Each status outranks every one after it in errors.STATUS_PRIORITY (a pairwise check of the
    whole order)."""
    as_report = {
        errors.CRASHED: lambda: report(notes={"host-9": "backend: gloo\n" + ABORT}),
        errors.ABORTED: lambda: report(notes={"host-9": ABORT}),
        errors.EXIT_KILLED: lambda: report(notes=KILLED),
    }
    order = errors.STATUS_PRIORITY
    for i, first in enumerate(order):
        for later in order[i + 1 :]:
            parts = [as_report[c]() if c in as_report else report(c) for c in (first, later)]
            merged = Report(
                statuses={
                    **{f"a{k}": v for k, v in parts[0].statuses.items()},
                    **{f"b{k}": v for k, v in parts[1].statuses.items()},
                },
                notes={
                    **{f"a{k}": v for k, v in parts[0].notes.items()},
                    **{f"b{k}": v for k, v in parts[1].notes.items()},
                },
                anything=True,
            )
            want = {errors.CRASHED: errors.EXIT_ERROR, errors.ABORTED: errors.EXIT_LOST_PEER}.get(
                first, first
            )
            assert policy.trainer_status(merged) == want, (first, later)


@pytest.mark.parametrize(
    "reported,status,line",
    [
        (2, 2, "bad input (exit status 2, the cause is above); not relaunched"),
        (5, 5, "the training diverged (exit status 5); not relaunched"),
        (1, 1, "the trainer failed with an error (exit status 1, traceback above); not relaunched"),
        (
            130,
            130,
            "stopped at once by a second Ctrl-C (exit status 130): no checkpoint of this step",
        ),
        (
            4,
            4,
            (
                "preempted (exit status 4): a checkpoint of the reached step was written; continue"
                " with --resume auto"
            ),
        ),
    ],
)
def test_what_a_relaunch_cannot_fix_ends_the_job_at_once(reported, status, line):
    got = decide(1, report(reported), nproc=1, max_restarts=5)
    assert got.exit_status == status and got.lines == [f"launch.sh: {line}"]


# (nothing reported: the launcher's status)
@pytest.mark.parametrize(
    "written,notes,status", [([3], {}, 3), ([], KILLED, 137), ([3, 3], KILLED, 3), ([], {}, 1)]
)
def test_a_lost_peer_or_a_kill_relaunches_up_to_max_restarts(written, notes, status):
    r = report(*written, notes=notes)
    relaunch = decide(1, r, nproc=2, attempt=0, max_restarts=1)
    assert relaunch.exit_status is None
    assert (
        relaunch.lines[-1]
        == f"launch.sh: the job failed (exit status {status}); relaunching to resume from the "
        "newest checkpoint"
    )
    last = decide(1, r, nproc=2, attempt=1, max_restarts=1)
    assert last.exit_status == status
    assert (
        last.lines[-1] == f"launch.sh: the job failed with exit status {status} after 2 attempt(s)"
    )


def test_a_kill_is_named_with_the_host_pid_and_an_abort_as_a_lost_peer():
    killed = decide(1, report(notes=KILLED), nproc=1)
    assert killed.lines[0].startswith("launch.sh: a rank was killed by a signal it cannot handle")
    assert "host-pid host-7)" in killed.lines[0] and killed.exit_status == 137
    aborted = decide(1, report(4, notes={"host-9": ABORT}), nproc=2)
    assert "ended by SIGABRT" in aborted.lines[0] and aborted.exit_status == 3
    crashed = decide(1, report(3, notes={"host-9": "backend: gloo\n" + ABORT}), nproc=2)
    assert "gloo process group ended by SIGABRT" in crashed.lines[0] and crashed.exit_status == 1


def test_restart_on_preempt_relaunches_a_preemption_that_did_not_come_through_the_launcher():
    assert (
        decide(1, report(4), nproc=1, restart_on_preempt=True, max_restarts=1).exit_status is None
    )
    told = decide(1, report(4), nproc=1, restart_on_preempt=True, max_restarts=1, signalled="TERM")
    assert told.exit_status == 4  # a stop the launcher was told of is never relaunched


def test_a_signalled_launcher_never_relaunches():
    got = decide(1, report(3), nproc=1, signalled="USR1", max_restarts=3)
    assert got.exit_status == 3 and got.lines == ["launch.sh: stopped by SIGUSR1 (exit status 3)"]


def test_a_signal_before_any_rank_wrote_anything_is_nothing_to_save():
    got = decide(143, Report(), nproc=1, signalled="USR1", max_restarts=1)
    assert got == policy.Decision(
        ["launch.sh: stopped by SIGUSR1 while the job started (nothing to save)"], 4
    )


def test_ranks_that_all_finished_make_the_job_a_success_whatever_their_launcher_says():
    got = decide(143, report(0, 0), nproc=2, signalled="TERM")
    assert got.exit_status == 0
    assert got.lines == [
        "launch.sh: the launcher ended with status 143, but every rank here had finished the run: "
        "exit status 0"
    ]
    assert decide(1, report(0), nproc=2).exit_status == 1  # one of two ranks is not the run's end
    assert decide(0, Report(), nproc=1) == policy.Decision([], 0)


def test_read_report_reads_the_status_folder(tmp_path):
    (tmp_path / "host-1").write_text("3\n")
    (tmp_path / "faults").mkdir()
    (tmp_path / "faults" / "host-1").write_text(CLEAN_NOTE)
    got = policy.read_report(tmp_path)
    assert got == Report(statuses={"host-1": "3\n"}, notes={"host-1": CLEAN_NOTE}, anything=True)
    assert policy.read_report(tmp_path / "gone") == Report()
    (tmp_path / "faults" / "host-1").unlink()
    (tmp_path / "host-1").unlink()
    assert policy.read_report(tmp_path).anything  # (an empty faults/ folder: a rank got that far)


def test_a_relaunch_whose_rendezvous_waited_in_vain_for_the_other_machines_ends_as_a_lost_peer():
    # no rank started (nothing reported), the attempt lasted --rejoin_wait: the others are not
    # coming
    gave_up = decide(
        1,
        Report(),
        nproc=2,
        attempt=1,
        max_restarts=3,
        machines=2,
        waited_s=120.5,
        rejoin_wait_s=120,
    )
    assert gave_up == policy.Decision([policy.not_rejoined(120)], errors.EXIT_LOST_PEER)
    assert "did not rejoin within 120 s (--rejoin_wait)" in gave_up.lines[0]
    # the first attempt, or an attempt that failed before the wait ran out: relaunched (a machine
    # missing from the rendezvous)
    for attempt, machines, waited in ((0, 2, 700.0), (1, 2, 5.0)):
        got = decide(
            1,
            Report(),
            nproc=2,
            attempt=attempt,
            max_restarts=3,
            machines=machines,
            waited_s=waited,
            rejoin_wait_s=120,
        )
        assert got.exit_status is None, (attempt, machines, waited)


def test_a_relaunch_resumes_and_its_rendezvous_waits_rejoin_wait():
    from accel_train.launcher import options
    from accel_train.launcher.plan import Plan

    env = {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "h0", "ACCEL_CONFIG": "2node_cpu"}
    plan = Plan(
        options.parse(["--dry-run", "--epochs", "1", "--timeout_s", "90"], env), env, "python3"
    )
    first, second = plan.attempt_cmd(0), plan.attempt_cmd(1)
    assert first[first.index("--rdzv_conf") + 1] == "timeout=600" and "--resume" not in first
    # the trainer's --timeout_s + 60
    assert second[second.index("--rdzv_conf") + 1] == "timeout=150"
    assert second[-2:] == ["--resume", "auto"] and (plan.wait_s(0), plan.wait_s(1)) == (600, 150)
    plan = Plan(options.parse(["--dry-run", "--rejoin_wait", "30"], env), env, "python3")
    assert plan.attempt_cmd(1)[plan.attempt_cmd(1).index("--rdzv_conf") + 1] == "timeout=30"


def test_a_one_machine_job_that_fails_before_any_rank_starts_is_an_error_never_relaunched():
    # --help: an error (1) is never relaunched. On one machine no rendezvous can fail: the
    # launcher's 1 with nothing written is accelerate's error or the trainer's failed start
    for attempt in (0, 1):
        got = decide(1, Report(), nproc=2, attempt=attempt, max_restarts=3, machines=1)
        assert got == policy.Decision(
            [
                "launch.sh: the job failed (exit status 1) before any rank started: an error (the"
                " cause is above); not relaunched"
            ],
            1,
        )
    # a rank that got as far as its first file (killed during start-up), another status, a signal:
    # as before
    assert decide(1, report(notes=KILLED), nproc=2, max_restarts=3).exit_status is None
    assert decide(137, Report(), nproc=1, max_restarts=3).exit_status is None
    assert decide(1, Report(), nproc=2, max_restarts=3, signalled="TERM").exit_status != 1
    assert decide(1, Report(), nproc=2, max_restarts=3, machines=2).exit_status is None


def test_a_rank_killed_during_start_up_is_named_alone_not_the_ranks_torchrun_stopped(tmp_path):
    # kill -9 of one rank while the job starts: torchrun SIGTERMs the others before their stop
    # handler is installed; each leaves its stack in its note's TERM_NOTE file (exits.note_aborts)
    faults = tmp_path / "faults"
    faults.mkdir()
    for name in ("h-1", "h-2", "h-3"):
        (faults / name).write_text("")
    (faults / f"h-1{TERM_NOTE}").write_text("")  # (never signalled: empty)
    (faults / f"h-2{TERM_NOTE}").write_text(
        'Current thread 0x1 (most recent call first):\n  File "x"'
    )
    (faults / f"h-3{TERM_NOTE}").write_text(
        'Current thread 0x2 (most recent call first):\n  File "y"'
    )
    got = policy.read_report(tmp_path)
    assert set(got.notes) == {"h-1", "h-2", "h-3"} and got.terminated == {"h-2", "h-3"}
    assert policy.killed_ranks(got) == ["h-1"]
    decided = decide(1, got, nproc=3, max_restarts=1)
    assert decided.exit_status is None  # (137: relaunched)
    assert any("host-pid h-1) and reported nothing: exit status 137" in x for x in decided.lines)
    assert any(
        x.startswith("launch.sh: rank(s) host-pid h-2 h-3 ended by SIGTERM while the job started")
        for x in decided.lines
    ), decided.lines
    # the agent killed alone: its ranks stop themselves, none named as killed
    (faults / f"h-1{TERM_NOTE}").write_text("Current thread 0x3 (most recent call first):\n")
    alone = decide(137, policy.read_report(tmp_path), nproc=3, max_restarts=1)
    assert not any("killed by a signal it cannot handle" in x for x in alone.lines), alone.lines
    assert alone.lines[-1] == (
        "launch.sh: the job failed (exit status 137); relaunching to resume from the newest"
        " checkpoint"
    )
