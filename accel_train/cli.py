"""Command line: `accel-train [train] [flags]`, `accel-train evaluate|predict|preflight ...`.

The train parser is generated from TrainConfig's fields. Flags take `--k v` and `--k=v`; booleans
also `--flag` alone and `--flag true|false`. Arguments a platform adds that we do not know are
ignored with one warning. Bad input is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import types
import typing

from . import __version__
from .config import EXIT_DIVERGED, ConfigError, Diverged, TrainConfig, fields, load_yaml

GROUPS = ("data", "model", "optimisation", "checkpointing", "logging", "performance", "platform")
TRUE, FALSE = ("1", "true", "yes", "y", "on"), ("0", "false", "no", "n", "off")


def str2bool(value: str) -> bool:
    v = str(value).strip().lower()
    if v in TRUE:
        return True
    if v in FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


class Parser(argparse.ArgumentParser):
    """argparse that reports errors as one line (ConfigError) instead of usage + exit."""

    def error(self, message):
        raise ConfigError(f"{message} (see {self.prog} --help)")


def _base_type(tp):
    """int | None -> int; bool -> bool."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union else tp


def train_parser() -> Parser:
    p = Parser(prog="accel-train", allow_abbrev=False,
               description="Train a timm model on CIFAR-10 or random data with Hugging Face Accelerate. "
                           "Start it with `accelerate launch --config_file accelerate_configs/<platform>.yaml "
                           "-m accel_train ...` or launch.sh; devices and ranks come from that config.",
               epilog="Other commands: accel-train evaluate | predict | preflight (each has --help).",
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


COMM_ERRORS = ("DistBackendError", "DistNetworkError", "DistStoreError")
COMM_PATTERNS = re.compile(r"gloo|nccl|hccl|connection (closed|reset)|closed by peer|timed out|broken pipe", re.I)


def cmd_train(argv: list[str]) -> int:
    cfg = parse_train_args(argv)
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
    except RuntimeError as e:
        if type(e).__name__ not in COMM_ERRORS and not COMM_PATTERNS.search(str(e)):
            raise
        lost_peer(e, cfg)
    return 0


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
    os._exit(3)


def cmd_evaluate(argv):
    from .evaluate import main_evaluate
    return main_evaluate(argv)


def cmd_predict(argv):
    from .evaluate import main_predict
    return main_predict(argv)


def cmd_preflight(argv):
    from .preflight import main_preflight
    return main_preflight(argv)


COMMANDS = {"train": cmd_train, "evaluate": cmd_evaluate, "predict": cmd_predict, "preflight": cmd_preflight}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", level=logging.INFO)
    logging.getLogger("accelerate").setLevel(logging.WARNING)  # its per-file save/load chatter
    command = argv.pop(0) if argv and argv[0] in COMMANDS else "train"
    try:
        return COMMANDS[command](argv)
    except ConfigError as e:
        print(f"accel-train: error: {e}", file=sys.stderr, flush=True)
        return 2
