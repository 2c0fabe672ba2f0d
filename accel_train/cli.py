"""Command line: `accel-train [train] [flags]`, `accel-train evaluate|predict|preflight|smoke ...`.

The train parser is generated from TrainConfig's fields. Flags take `--k v` and `--k=v`; booleans
also `--flag` alone and `--flag true|false`. Arguments a platform adds that we do not know are
ignored with one warning. Bad input is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import re
import socket
import sys
import traceback
import types
import typing
from pathlib import Path

from . import __version__
from .config import (EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_ERROR, EXIT_LOST_PEER, EXIT_OK, EXIT_PREEMPTED, ConfigError,
                     Diverged, Parser, Preempted, TrainConfig, fields, load_yaml)
from .preempt import EXIT_INTERRUPTED

GROUPS = ("data", "model", "optimisation", "checkpointing", "logging", "performance", "platform")
TRUE, FALSE = ("1", "true", "yes", "y", "on"), ("0", "false", "no", "n", "off")


def str2bool(value: str) -> bool:
    v = str(value).strip().lower()
    if v in TRUE:
        return True
    if v in FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def _base_type(tp):
    """int | None -> int; bool -> bool."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union else tp


def train_parser() -> Parser:
    p = Parser(prog="accel-train", allow_abbrev=False,
               description="Train a timm model on CIFAR-10, an image folder or random data with Hugging Face "
                           "Accelerate. "
                           "Start it with `accelerate launch --config_file accelerate_configs/<platform>.yaml "
                           "-m accel_train ...` or launch.sh; devices and ranks come from that config.",
               epilog="Other commands: accel-train evaluate | predict | preflight | smoke (each has --help).",
               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--version", action="version", version=f"accel_train {__version__}")
    p.add_argument("--config", metavar="YAML", help="start from a config.yaml written by an earlier run; "
                   "flags given here override it")
    groups = {g: p.add_argument_group(g) for g in GROUPS}
    hints = typing.get_type_hints(TrainConfig)
    for f in fields():
        meta = f.metadata
        kind = _base_type(hints[f.name])
        kwargs = dict(dest=f.name, default=f.default, help=meta["help"])
        if kind is bool:
            kwargs.update(type=str2bool, nargs="?", const=True, metavar="BOOL")
        else:
            kwargs.update(type=kind, metavar=f.name.upper())
        if "choices" in meta:
            kwargs.update(choices=meta["choices"], metavar=None)
        groups[meta["group"]].add_argument(f"--{f.name}", *meta.get("aliases", ()), **kwargs)
    return p


def parse_train_args(argv: list[str]) -> TrainConfig:
    parser = train_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.config:
        parser.set_defaults(**load_yaml(args.config))
        args, unknown = parser.parse_known_args(argv)
    if unknown:
        logging.getLogger("accel_train").warning(f"ignoring unknown arguments: {' '.join(unknown)}")
    values = {f.name: getattr(args, f.name) for f in fields()}
    return TrainConfig(**values)


# A lost peer, by exception type and by where the message comes from (the transport layer of the
# collective library), never by loose words: a DataLoader timeout or an NCCL usage error is a bug to show.
LOST_PEER_TYPES = ("DistNetworkError", "DistStoreError")
LOST_PEER_ORIGINS = re.compile(r"gloo/transport/|ncclRemoteError|ncclSystemError|remote process exited|"
                               r"Watchdog caught collective operation timeout|HCCL.*(timeout|heartbeat)", re.I)


def is_lost_peer(error: BaseException) -> bool:
    names = {c.__name__ for c in type(error).__mro__}
    if names & set(LOST_PEER_TYPES):
        return True
    return isinstance(error, RuntimeError) and bool(LOST_PEER_ORIGINS.search(str(error)))


def note_aborts() -> None:
    """Under launch.sh: a rank ended by SIGABRT (NCCL's watchdog at the collective timeout, no Python exception)
    leaves a note in ACCEL_TRAIN_STATUS_DIR/faults/ (Python's faulthandler), which launch.sh reads as a lost peer."""
    folder = os.environ.get("ACCEL_TRAIN_STATUS_DIR")
    if not folder:
        return
    try:
        Path(folder, "faults").mkdir(exist_ok=True)
        note = open(Path(folder, "faults", f"{socket.gethostname()}-{os.getpid()}"), "w")
    except OSError:
        return
    faulthandler.enable(file=note)  # (it keeps the file open as long as it is enabled)
    _fault_notes.append(note)


_fault_notes: list = []


def cmd_train(argv: list[str]) -> int:
    cfg = parse_train_args(argv)
    note_aborts()
    from .loop import train  # heavy imports after the arguments are known to be good
    try:
        train(cfg)
    except Diverged as e:  # every rank stopped at the same step; the main process says why
        from accelerate import PartialState
        state = PartialState()
        if state.is_main_process:
            print(f"\naccel-train: error: {e}", file=sys.stderr, flush=True)  # (after any progress bar)
        state.wait_for_everyone()  # the line is out before any rank exits (torchrun then stops the rest)
        return EXIT_DIVERGED
    except Exception as e:
        if not is_lost_peer(e):
            raise
        lost_peer(e, cfg)
    return EXIT_OK


def lost_peer(error: Exception, cfg) -> None:
    """A collective failed: a peer died or stopped answering. One line, then exit without teardown
    (destroying a process group whose peer is gone can hang)."""
    from .checkpoint import checkpoint_dirs
    text = " ".join(str(error).split())
    peer = re.search(r"\[([0-9a-fA-F.:]+)\]:\d+", text) or re.search(r"(\d+\.\d+\.\d+\.\d+:\d+)", text)
    detail = re.sub(r"\[/?[^\]]*\.(cc|cpp|hpp):\d+\]\s*", "", text)[:160]
    found = checkpoint_dirs(cfg.output_dir)
    where = f"newest complete checkpoint: {found[-1]}" if found else "no complete checkpoint yet"
    print(f"\naccel-train: error: lost contact with peer {peer.group(1) if peer else '(unknown)'} during a collective "
          f"({detail}); the job stops here, {where}; relaunch with --resume auto (launch.sh --max_restarts N does "
          "it) once every node is back", file=sys.stderr, flush=True)
    report_status(EXIT_LOST_PEER)
    os._exit(EXIT_LOST_PEER)


def report_status(code: int) -> None:
    """Tell launch.sh this process's exit status (`accelerate launch` itself returns 1 for any failure)."""
    folder = os.environ.get("ACCEL_TRAIN_STATUS_DIR")
    if folder:
        try:
            Path(folder, f"{socket.gethostname()}-{os.getpid()}").write_text(f"{code}\n")
        except OSError:
            pass


def cmd_evaluate(argv):
    from .evaluate import main_evaluate
    return main_evaluate(argv)


def cmd_predict(argv):
    from .evaluate import main_predict
    return main_predict(argv)


def cmd_preflight(argv):
    from .preflight import main_preflight
    return main_preflight(argv)


def cmd_smoke(argv):
    from .smoke import main_smoke
    return main_smoke(argv)


COMMANDS = {"train": cmd_train, "evaluate": cmd_evaluate, "predict": cmd_predict, "preflight": cmd_preflight,
            "smoke": cmd_smoke}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", level=logging.INFO)
    logging.getLogger("accelerate").setLevel(logging.WARNING)  # its per-file save/load chatter
    command = argv.pop(0) if argv and argv[0] in COMMANDS else "train"
    try:
        code = COMMANDS[command](argv)
    except ConfigError as e:
        if not e.quiet:
            print(f"accel-train: error: {e}", file=sys.stderr, flush=True)
        code = EXIT_BAD_INPUT
    except Preempted as e:
        print(f"accel-train: preempted: {e}", file=sys.stderr, flush=True)
        code = EXIT_PREEMPTED
    except KeyboardInterrupt:  # Ctrl-C outside the training loop's handler (imports, the final export)
        print("\naccel-train: interrupted (Ctrl-C); a training run continues from its newest complete checkpoint "
              "with --resume auto", file=sys.stderr, flush=True)
        code = EXIT_INTERRUPTED
    except Exception:
        traceback.print_exc()
        code = EXIT_ERROR
    report_status(code)
    return code
