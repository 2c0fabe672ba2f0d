"""The survivor save: a lost peer costs at most the step in flight.

When a collective fails or times out (a peer's process killed, its machine gone, the network cut, a
hung peer), every surviving rank still holds the weights, optimizer state, EMA and metrics rows of
the last optimizer step it completed, and the data position is a function of (epoch, batch). The
lowest surviving rank of each machine writes that step as an ordinary checkpoint on its own storage,
without any collective, then exits with the lost-peer status (3) and one line saying which step was
saved where, in how many seconds (exits.lost_peer). `--resume auto` takes the newest complete
checkpoint on any machine (resume.py), so the relaunch loses no completed step.

One step, exactly: the loop changes the weights, the step counter, the lr and the EMA only inside
`survivor.lock` (Survivor.updating, around loop.apply_step), a region without any collective; the
data position saved is the start of the accumulation window; the step's metrics row, when its reduce
did not complete, is this rank's own loss. A failure inside that region (which holds no collective:
only a bug) saves nothing.

A SIGTERM (torchrun's agent stops the other workers of a machine 30 s after one dies; a platform
stopping the remaining machines) cannot wait for an agreed check whose peer is gone, and a main
thread blocked in a collective never runs Python's signal handler: the C-level handler writes the
signal to a wakeup fd read by a thread here, which saves at once if a local peer is dead or stopped,
else once GRACE_S / 2 (or two measured steps, if longer) pass without a step completing (each step's
all-reduce proves every peer answers) or GRACE_S - LATE_S after the signal, unless the ranks have
agreed on the stop by then (preempt.AgreedChecks sets `stop.agreed` and `stop.step_s`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, replace
from pathlib import Path

import torch
from accelerate.utils import gather_object
from accelerate.utils.constants import (
    OPTIMIZER_NAME as ACCELERATE_OPTIMIZER_NAME,
)
from accelerate.utils.constants import (
    SAFE_WEIGHTS_NAME,
    SCALER_NAME,
)
from accelerate.utils.other import clean_state_dict_for_safetensors

from ..checkpoint.checkpointer import TrainState, save_safetensors
from ..errors import is_lost_peer
from ..exits import note_bad_input, peer_gone
from ..files import (
    EMA_FILE,
    HISTORY,
    METRICS_FILE,
    MODEL_CONFIG_FILE,
    STEPS_FILE,
    complete,
    dumps,
    publish,
    seal,
    step_dir,
    write_output,
)
from .device_copy import state_to_host  # the one place where training state is read off the device
from .heartbeat import Heartbeat, alive, reachable
from .preempt import SIGNALS

# torchrun's agent SIGKILLs its workers 30 s after its SIGTERM (its _shutdown; pytorch#119856)
GRACE_S = 30.0
# a signal not agreed on by then is answered by a survivor save anyway, before that SIGKILL
LATE_S = 5.0
# after a signal, no step for this many of the slowest rank's measured steps (and GRACE_S / 2):
# stalled
STALL_STEPS = 2.0
# accelerate's file names in a checkpoint, as save_state names the first model (SAFE_WEIGHTS_NAME),
# optimizer and scaler (SCALER_NAME): accelerate/checkpointing.py save_accelerator_state
OPTIMIZER_NAME = f"{ACCELERATE_OPTIMIZER_NAME}.bin"


def readable_step(device: torch.device) -> str | None:
    """Why the device's memory holds no step that can be named (None: it holds the host's last
    completed step). On CUDA and NPU the host runs ahead of the device (DDP's all-reduce does not
    block it), and the backend's abort of the failed collective lets the updates queued behind it
    run on a partly reduced gradient: the state then belongs to no step (docs/failures.md,
    device_copy.py). On a CPU (gloo) the collective runs in the calling thread."""
    if device.type == "cpu":
        return None
    return (
        f"nothing saved: on {device.type} the state after the failed collective belongs to no "
        "step (the device runs behind the host; docs/failures.md)"
    )


WATCHED: list[int] = []  # this process's signal watch pipe (read, write) while a watch runs


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker) neither writes its signals into the parent's watch pipe
    (Python's C handler writes every handled signal to the wakeup fd, which fork copies: a SIGTERM
    to a worker alone made its trainer save and exit 3 25 s later) nor holds the pipe open."""
    if WATCHED:
        try:
            previous = signal.set_wakeup_fd(-1)
            if previous not in WATCHED:  # (not the watch's: the child's own)
                signal.set_wakeup_fd(previous)
        except ValueError:  # (not the child's main thread)
            pass
        for fd in WATCHED:
            os.close(fd)
        WATCHED.clear()


os.register_at_fork(after_in_child=_forget_in_child)


class Survivor:
    """Knows the last completed step of this rank and writes it when a peer is lost. Every rank
    makes one (one gather at start: the pids of each machine's ranks); `guard()` wraps the
    training."""

    def __init__(self, run, cfg, checkpointer, metrics, stop, hang=None):
        self.run, self.cfg, self.checkpointer, self.metrics, self.stop = (
            run,
            cfg,
            checkpointer,
            metrics,
            stop,
        )
        # held while the weights, step, lr and EMA change (no collective inside)
        self.lock = threading.Lock()
        self.saving = threading.Lock()  # one survivor save per process
        self.first_step = run.state.step  # nothing new to save before a step beyond it
        # (step, loss on the device, lr) of a row whose reduce may not complete
        self.row = None
        # what the save said; who saved ("main" or "watch"), and so speaks
        self.result, self.owner = None, None
        acc = run.accelerator
        # (heartbeat.py; hang.py's channel)
        beats = acc.num_processes > 1 and cfg.heartbeat_timeout_s > 0
        self.heartbeat = (
            Heartbeat(
                acc.process_index, cfg.heartbeat_s, cfg.heartbeat_timeout_s, acc.num_processes
            )
            if beats
            else None
        )
        me = (
            socket.gethostname(),
            os.getpid(),
            acc.local_process_index,
            *(self.heartbeat.card() if beats else ()),
        )
        ranks = gather_object([me]) if acc.num_processes > 1 else [me]
        self.ranks = ranks
        self.lower = [pid for host, pid, local, *_ in ranks if host == me[0] and local < me[2]]
        self.local = [pid for host, pid, *_ in ranks if host == me[0] and pid != me[1]]
        self.watcher = self._watch_signals() if acc.num_processes > 1 else None
        if beats:
            self.heartbeat.start(
                {
                    r: (ip, ports, pid, public)
                    for r, (host, pid, _, ip, ports, public) in enumerate(ranks)
                    if reachable(me[0], me[3], host, ip)
                },
                self._silent,
            )
        # (the stacks)
        hang.attach(acc.process_index, self.heartbeat, self._hung) if hang is not None else None
        # BatchNorm's running statistics: DDP broadcasts rank 0's at the start of the first forward
        # of each accumulation window (torch/nn/parallel/distributed.py: _pre_forward syncs buffers
        # when the previous forward was a syncing one, require_forward_param_sync, set in
        # _post_forward), before the module runs. A pre-hook on the module keeps them there (one
        # fused copy per step, a few KB; none where no step is saved: readable_step): rank 0's at
        # the end of the step before, exactly what rank 0 would save. Compiled: their own, as
        # `updating` ends a step.
        module = (
            acc._models[0] if acc.num_processes > 1 and readable_step(acc.device) is None else None
        )
        kept = set(module.state_dict()) if module is not None else set()
        named = [
            (n, b) for n, b in (module.named_buffers() if module is not None else ()) if n in kept
        ]
        self.buffer_names, self.buffers = [n for n, _ in named], [b for _, b in named]
        self.kept, self.kept_step = [b.detach().clone() for b in self.buffers], -1
        self.kept_own = False  # `kept` holds this rank's own statistics (else rank 0's)
        self.hooked = (
            bool(self.buffers)
            and not hasattr(run.model, "_orig_mod")
            and not hasattr(module, "_orig_mod")
        )
        # (close removes)
        self.hook = module.register_forward_pre_hook(self._window_start) if self.hooked else None
        if self.buffers and checkpointer is not None:  # (a checkpoint's write sends rank 0's: kept)
            checkpointer.buffers_shared = self._keep

    def _keep(self, step: int, own: bool = False, locked: bool = False) -> None:
        with nullcontext() if locked else self.lock:
            torch._foreach_copy_(self.kept, self.buffers)
            self.kept_step, self.kept_own = step, own

    def _window_start(self, module, args) -> None:
        state = self.run.state
        if (
            module.training
            and state.batch_in_epoch % self.run.accelerator.gradient_accumulation_steps == 0
        ):
            self._keep(state.step)

    @contextmanager
    def updating(self, step_ends: bool):
        """Around a micro-batch's update of the training state: where it ends an optimizer step (the
        weights, step, lr and EMA change), under `lock`, so that a save sees the step whole or not
        begun. A failure inside leaves the lock held: a save in the main thread then knows the state
        is half updated and saves nothing."""
        if not step_ends:
            yield
            return
        self.lock.acquire()
        yield  # (not in try/finally: an exception raised here skips the release on purpose)
        if self.buffers and not self.hooked:
            self._keep(self.run.state.step, own=True, locked=True)
        self.lock.release()

    # ---- the training side: a lost peer raised in the main thread
    @contextmanager
    def guard(self):
        try:
            yield self
        except Exception as error:
            # (a bad file one rank's worker met: its peers say it too)
            note_bad_input(self.cfg.output_dir, error)
            if is_lost_peer(error):  # (exits.lost_peer then says it and exits 3)
                error.survivor = self.save(" ".join(str(error).split())[:160], in_main=True)
                # the signal watch saved first: it says so and exits (one status file)
                if self.owner == "watch":
                    threading.Event().wait()
            raise
        finally:
            self.close()

    def note_row(self, step: int, loss: torch.Tensor, lr: float) -> None:
        """The step's row is due; its loss (this rank's) stands in if the reduce over ranks does not
        complete."""
        self.row = (step, loss, lr)

    def close(self) -> None:
        self.closed = True  # the training is over (or stopped): an armed watch stands down
        if getattr(self, "heartbeat", None) is not None:
            self.heartbeat.close()  # (a goodbye: no alarm at this rank's silence from here on)
        # a module given to train() is handed back without it (its lock would make copy.deepcopy
        # and torch.save of the module fail)
        if getattr(self, "hook", None) is not None:
            self.hook.remove()
            self.hook = None
        if self.watcher is not None:
            signal.set_wakeup_fd(self.watcher[1])
            WATCHED.clear()
            # the write end first: the thread reads its end of file and returns
            for fd in self.watcher[:1:-1]:
                os.close(fd)
            self.watcher = None

    # ---- the save
    def save(self, failure: str, in_main: bool = False) -> str:
        """Write the last completed step (if this process is its machine's lowest surviving rank);
        the words that say what was saved where, in how many seconds, or why nothing was."""
        with self.saving:
            if self.result is not None:
                return self.result
            self.owner = "main" if in_main else "watch"
            # the failure came inside the step's update: no consistent state
            if in_main and self.lock.locked():
                self.result = "nothing saved: the failure came while this rank applied a step"
                return self.result
            if not in_main:
                # never released: the main thread stops at its next step's update
                self.lock.acquire()
            try:
                self.result = self._save(failure)
            # (a full disk, a device that cannot be read): said, never raised over the cause
            except Exception as e:
                self.result = (
                    f"the survivor save failed ({type(e).__name__}: "
                    f"{' '.join(str(e).split())[:120]})"
                )
            return self.result

    def _save(self, failure: str) -> str:
        run, start = self.run, time.perf_counter()
        # no collective here: this rank's sums are not the epoch's, so none are kept (the resumed
        # row says it is partial)
        state = replace(run.state, epoch_sums=None)
        k = run.accelerator.gradient_accumulation_steps
        # the start of the accumulation window in flight
        state.batch_in_epoch -= state.batch_in_epoch % k
        if readable_step(run.accelerator.device) is not None:
            return readable_step(run.accelerator.device)
        if state.step <= self.first_step:
            return f"no step completed since step {self.first_step}: nothing new to save"
        if any(alive(pid) for pid in self.lower):
            return f"step {state.step} is saved by a lower rank of this machine"
        final = step_dir(self.cfg.output_dir, state.step)
        if complete(final):
            return f"step {state.step} was already saved in {final}"
        tmp = final.parent / f".tmp-{final.name}-survivor-{run.accelerator.process_index}"
        # the buffers of the completed step: rank 0's (or, compiled, this rank's own) as kept, else
        # the live ones (no forward has run since the step: this rank's own, or rank 0's where an
        # evaluation's forward broadcast them)
        kept = self.kept_step == state.step
        buffers = dict(zip(self.buffer_names, self.kept if kept else self.buffers))
        own = not kept or self.kept_own
        source = f"rank {run.accelerator.process_index} (its own)" if own else "rank 0"
        try:
            write_state(
                run, self.checkpointer, state, self._history(state), buffers, tmp, failure, source
            )
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # (nothing partial left behind)
            raise
        # the checkpoint of this step that the lost peer interrupted, if any
        if self.checkpointer.decision.writer:
            shutil.rmtree(final.parent / f".tmp-{final.name}", ignore_errors=True)
        if not publish(tmp, final):
            return f"step {state.step} was saved in {final} by another survivor"
        return (
            f"step {state.step} saved by the survivor in {final} in "
            f"{time.perf_counter() - start:.1f} s"
        )

    def _history(self, state: TrainState) -> dict:
        history = self.metrics.history()
        rows = [r for r in history[METRICS_FILE] if r["epoch"] <= state.epoch]
        steps = [r for r in history[STEPS_FILE] if r["step"] <= state.step]
        if (
            self.row is not None
            and self.row[0] == state.step
            and (not steps or steps[-1]["step"] != state.step)
        ):
            step, loss, lr = self.row  # the reduce did not complete: this rank's own loss, said so
            steps.append(
                {
                    "step": step,
                    "loss": float(state_to_host(loss)),
                    "lr": lr,
                    "loss_of": f"rank {self.run.accelerator.process_index} only",
                }
            )
        return {METRICS_FILE: rows, STEPS_FILE: steps}

    # ---- the signal side: torchrun's SIGTERM while the main thread may be blocked in a collective
    def _watch_signals(self):
        if threading.current_thread() is not threading.main_thread():
            return None
        read, write = os.pipe()
        os.set_blocking(write, False)
        previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        WATCHED[:] = [read, write]
        threading.Thread(
            target=self._on_signal, args=(read,), daemon=True, name="accel_train-survivor"
        ).start()
        return (None, previous, read, write)

    def _on_signal(self, fd: int) -> None:
        try:
            while os.read(fd, 1)[0] not in {int(s) for s in SIGNALS}:
                pass
        except (OSError, IndexError):
            return
        armed = moved = time.monotonic()
        step = self.run.state.step
        while not getattr(self.stop, "agreed", False) and not getattr(self, "closed", False):
            now, gone = time.monotonic(), [pid for pid in self.local if not alive(pid)]
            if self.run.state.step != step:  # a step completed: every peer answered its all-reduce
                step, moved = self.run.state.step, now
            # a step that takes longer than its measured time (STALL_STEPS of them, at least
            # GRACE_S / 2) is a peer that does not answer; before a step is measured (the first may
            # compile), only `late` says so
            step_s = getattr(self.stop, "step_s", None)
            wait = max(GRACE_S / 2, STALL_STEPS * step_s) if step_s is not None else None
            # a checkpoint being written is this step being saved (a peer lost in its collectives
            # raises there): no save beside it, which would remove the writer's .tmp-step_N and
            # exit 3 instead of the agreed stop's 4
            writing = getattr(getattr(self, "checkpointer", None), "writing", False)
            moved = now if writing else moved
            stalled, late = (
                wait is not None and now - moved > wait,
                not writing and now - armed > GRACE_S - LATE_S,
            )
            if gone or stalled or late:
                why = (
                    f"local rank process {gone[0]} is gone"
                    if gone
                    else (
                        f"no step and no agreed stop for {wait:.0f} s after the signal: a peer does"
                        " not answer"
                        if stalled
                        else f"no agreed stop {GRACE_S - LATE_S:.0f} s after the signal"
                    )
                )
                return self._gone(
                    f"{signal.Signals(self.stop.signal or signal.SIGTERM).name} while {why}",
                    f"lost contact with a peer ({why})",
                    gone[:1],
                )
            time.sleep(0.1)

    def _silent(self, rank: int, seconds: float) -> None:
        """The heartbeat's thread: rank `rank` has been silent for `seconds` (frozen, its machine
        paused, cut off)."""
        host, pid, _, ip = self.ranks[rank][:4]
        why = (
            f"rank {rank} on {host} sent no heartbeat for {seconds:.0f} s: stopped, frozen or "
            "cut off"
        )
        self._gone(f"heartbeat: {why}", f"lost contact with peer {ip} ({why})", [pid])

    def _hung(self, why: str) -> None:
        """The hang report's thread, with --stop_on_hang: the run ends as for a lost peer."""
        self._gone(f"hang: {why}", f"{why}; --stop_on_hang ends the run", [os.getpid()])

    def _gone(self, failure: str, what: str, pids: list) -> None:
        """A watch thread found a peer gone: the survivor save, one line, exit 3 (unless the main
        thread saved first: it says so and exits)."""
        said = self.save(failure)
        if self.owner == "watch":
            peer_gone(
                f"{what}; {said}; relaunch with --resume auto (launch.sh --max_restarts N "
                "does it) once every node is back",
                said,
                self.cfg.output_dir,
                pids,
            )


def write_state(
    run,
    checkpointer,
    state: TrainState,
    history: dict,
    buffers: dict,
    tmp: Path,
    failure: str,
    source: str,
) -> None:
    """A whole checkpoint of `state` in `tmp`, in save_checkpoint's format, from this rank alone (no
    collective); `buffers`: the model's buffers at the end of that step, of rank `source`."""
    acc = run.accelerator
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # what save_state writes: the models prepare() registered (the module itself, not its DDP
    # wrapper), its own call
    weights = acc.get_state_dict(acc._models[0], unwrap=False)
    weights = clean_state_dict_for_safetensors(state_to_host({**weights, **buffers}))
    save_safetensors(weights, tmp / SAFE_WEIGHTS_NAME, metadata={"format": "pt"})
    torch.save(state_to_host(run.optimizer.state_dict()), tmp / OPTIMIZER_NAME)
    if getattr(acc, "scaler", None) is not None:
        torch.save(state_to_host(acc.scaler.state_dict()), tmp / SCALER_NAME)
    if run.ema is not None:
        save_safetensors(state_to_host(run.ema.module.state_dict()), tmp / EMA_FILE)
    if checkpointer.facts is not None:
        write_output(
            tmp / MODEL_CONFIG_FILE,
            json.dumps({**checkpointer.facts, "metrics": {"step": state.step}}, indent=1),
        )
    for name in HISTORY:
        write_output(tmp / name, "".join(dumps(r) + "\n" for r in history[name]))
    rank = acc.process_index
    meta = {
        **asdict(state),
        "run": checkpointer.run_math,
        "ema": run.ema is not None,
        "num_processes": acc.num_processes,
        "survivor": {
            "rank": rank,
            "failure": failure,
            "host": socket.gethostname(),
            # BatchNorm's statistics (docs/failures.md: What a failure costs)
            "buffers_of": source,
        },
    }
    seal(tmp, meta)
