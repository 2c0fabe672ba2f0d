"""Command line: `accel-train [train] [flags]`, `accel-train evaluate|predict|preflight|smoke ...`.

The train parser is generated from TrainConfig's fields. Flags take `--k v` and `--k=v`; booleans
also `--flag` alone and `--flag true|false`. An unknown flag is bad input (with the nearest known
flag), except those named in ACCEL_TRAIN_IGNORE_ARGS (a platform's own arguments). Bad input is one
line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import re
import sys
import typing

import yaml

from . import __version__
from .checkpoint.changes import run_settings
from .config.flag_types import base_type
from .config.resolved import Taken, read_yaml
from .config.train_config import TrainConfig, fields
from .errors import EXIT_OK, ConfigError
from .exits import exit_rank
from .parser import Parser
from .status import status_of

GROUPS = ("data", "model", "optimisation", "checkpointing", "logging", "performance", "platform")
TRUE, FALSE = ("1", "true", "yes", "y", "on"), ("0", "false", "no", "n", "off")


def str2bool(value: str) -> bool:
    v = str(value).strip().lower()
    if v in TRUE:
        return True
    if v in FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def load_yaml(path) -> dict:
    """Read a config.yaml written by a run (config.resolved: any format so far) or by hand: the
    settings it holds; unknown keys are an error."""
    try:
        with open(path) as f:
            values = yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigError(f"cannot read --config {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"--config {path} is not valid YAML ({where}{what})") from None
    if not isinstance(values, dict):
        raise ConfigError(f"--config {path} must hold a mapping of option: value")
    values, _ = read_yaml(values, path)  # (the run's settings; what was asked replays nothing)
    known = {f.name for f in fields()}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(
            f"--config {path}: unknown key(s) {', '.join(unknown)}; see accel-train --help"
        )
    return values


def train_parser() -> Parser:
    # (argparse's usage would list every flag: 45 lines)
    p = Parser(
        prog="accel-train",
        allow_abbrev=False,
        usage=(
            "accel-train [--config YAML] [--flag value ...] (the flags below, by group)\n"
            "       accel-train evaluate | predict | preflight | smoke ... (each has "
            "--help)"
        ),
        description=(
            "Train a timm model on CIFAR-10, an image folder or random data with "
            "Hugging Face Accelerate. Start it with `python -m accel_train ...` "
            "(one process: a GPU if there is one, else the CPU); on several "
            "processes or machines with `accelerate launch --config_file "
            "accelerate_configs/<platform>.yaml -m accel_train ...` or launch.sh, "
            "whose config gives the devices and ranks."
        ),
        epilog=(
            "An unknown flag is an error; to let a platform's own extra "
            "arguments through, name them in the environment: "
            f"{IGNORE_ARGS}=--flag1,--flag2 (or '*' for any)."
        ),
    )
    p.add_argument("--version", action="version", version=f"accel_train {__version__}")
    p.add_argument(
        "--config",
        metavar="YAML",
        help="start from a config.yaml written by an earlier run; flags given here override it",
    )
    groups = {g: p.add_argument_group(g) for g in GROUPS}
    hints = typing.get_type_hints(TrainConfig)
    for f in fields():
        meta = f.metadata
        kind = base_type(hints[f.name])
        kwargs = dict(dest=f.name, default=f.default, help=meta["help"])
        if kind is bool:
            kwargs.update(type=str2bool, nargs="?", const=True, metavar="BOOL")
        else:
            kwargs.update(type=kind, metavar=f.name.upper())
        if "choices" in meta:
            kwargs.update(choices=meta["choices"], metavar=None)
        groups[meta["group"]].add_argument(f"--{f.name}", *meta.get("aliases", ()), **kwargs)
    return p


# The one way to let a platform's own extra arguments through: name them in this variable.
IGNORE_ARGS = "ACCEL_TRAIN_IGNORE_ARGS"


def parse_train_args(argv: list[str], env=os.environ) -> TrainConfig:
    """The run's TrainConfig from the command line (and its --config), with what a resume took from
    the run's record (`taken`: said by the main process once the run starts, its settings shared
    with a machine that has no record; a script passes the config to train(), which reads it)."""
    parser = train_parser()
    args, unknown = parser.parse_known_args(argv)
    file = load_yaml(args.config) if args.config else {}
    check_file_types(parser, file, args.config)
    # trust comes from the command line (or train()), never from a file
    file.pop("trust_model_code", None)
    if file:
        parser.set_defaults(**file)
        args, unknown = parser.parse_known_args(argv)
    check_unknown(parser, unknown, env.get(IGNORE_ARGS, ""))
    values = {f.name: getattr(args, f.name) for f in fields()}
    flags = given(parser, argv)
    # code named by a file: the command line trusts it
    if ":" in str(file.get("model", "")) and "model" not in flags:
        from .model.own_model import allow_import

        allow_import(values["model"], args.trust_model_code, None, f"--config {args.config}")
    # a resume's settings that the command line leaves out: the run's own
    said, taken = run_settings(values, flags | set(file), load_yaml)
    cfg = TrainConfig(**seed_data_alias(values, flags, file))
    cfg.taken = Taken(said, taken)
    return cfg


def check_file_types(parser: argparse.ArgumentParser, file: dict, path) -> None:
    """A --config file's value that its flag's type refuses is named by the file and key (argparse
    would name the flag, which the command line does not hold)."""
    for action in parser._actions:
        value = file.get(action.dest)
        if not isinstance(value, str) or action.type is None:
            continue
        try:
            action.type(value)
        except (ValueError, TypeError, argparse.ArgumentTypeError):
            kind = getattr(action.type, "__name__", "value")
            raise ConfigError(
                f"--config {path}: key {action.dest}: {value!r} is not a valid "
                f"{'true/false' if kind == 'str2bool' else kind}; fix it in the "
                "file (or pass --" + action.dest + " on the command line)"
            ) from None


def given(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The options the command line itself names (not their defaults, nor a --config file's
    values)."""
    dests = {option: action.dest for action in parser._actions for option in action.option_strings}
    return {
        dests[token.split("=", 1)[0]] for token in map(str, argv) if token.split("=", 1)[0] in dests
    }


def seed_data_alias(values: dict, flags: set[str], file: dict) -> dict:
    """The seed's --custom_data true|false resolved into --data random|cifar10 (and then dropped, so
    config.yaml records the data itself). Flags override the file; --custom_data and a --data that
    disagree on the command line (or in one file) are refused."""
    alias = values.pop("custom_data")
    if alias is None:
        return {**values, "custom_data": None}
    implied = "random" if alias else "cifar10"
    if "data" in flags and "custom_data" not in flags:  # a flag over the file's alias
        return {**values, "custom_data": None}
    both = "data" in flags if "custom_data" in flags else "data" in file  # said in one place
    if both and values["data"] != implied:
        raise ConfigError(
            f"--custom_data {str(alias).lower()} means --data {implied}, but --data "
            f"{values['data']} is given too; pass one of them"
        )
    return {**values, "data": implied, "custom_data": None}


# timm train.py's flags that a timm user types: a near-miss hint would mislead (--sched is not
# "--seed", --aa is not "--data") and ignoring one would train another run than the one asked for
# (--opt adamw as SGD). Each is refused with what this trainer does instead, never let through,
# never "did you mean".
TIMM_FLAGS = {
    "--color-jitter": "here: --color_jitter",
    "--train-interpolation": "here: --train_interpolation",
    "--crop-pct": "here: --crop_pct",
    "--layer-decay": "here: --layer_decay",
    "--drop-path": "here: --drop_path",
    "--drop": "here: --drop_rate",
    "--pretrained-path": "here: --pretrained_path",
    "--smoothing": "here: --label_smoothing",
    "--model-ema": "here: --ema",
    "--model-ema-decay": "here: --ema_decay",
    "--amp": "here: --mixed_precision bf16 (or fp16)",
    "--initial-checkpoint": "here: --init_from",
    "--output": "here: --output_dir",
    "--workers": "here: --num_workers",
    "-j": "here: --num_workers",
    "-b": "here: --batch_size",
    "--img-size": "here: --image_size",
    "--input-size": "here: --image_size",
}


def check_unknown(parser: argparse.ArgumentParser, unknown: list[str], allowed: str) -> None:
    """Arguments argparse did not know: an error naming each one with its nearest known flag, unless
    named in ACCEL_TRAIN_IGNORE_ARGS ('--a,--b' or '--a --b'; '*' lets every unknown argument
    through), then ignored with one warning. A value that follows an unknown flag belongs to it."""
    allow = {a.strip().split("=", 1)[0] for a in allowed.replace(",", " ").split()}
    groups: list[list[str]] = []
    for token in unknown:
        is_flag = token.startswith("-") and not re.fullmatch(r"-\d[\d.e+-]*", token)
        if is_flag or not groups or not groups[-1][0].startswith("-"):
            groups.append([token])
        else:
            groups[-1].append(token)
    let_through, wrong = [], []
    for group in groups:
        name = group[0].split("=", 1)[0]
        # (a timm flag changes the run)
        let = ("*" in allow or name in allow) and name not in TIMM_FLAGS
        (let_through if let else wrong).append(group)
    if let_through:
        logging.getLogger("accel_train").warning(
            f"ignoring arguments named in {IGNORE_ARGS}: "
            f"{' '.join(t for g in let_through for t in g)}"
        )
    if not wrong:
        return
    known = sorted(o for o in parser._option_string_actions if o.startswith("--"))
    parts = []
    for group in wrong:
        name = group[0].split("=", 1)[0]
        if not name.startswith("-"):
            parts.append(f"{name!r} (not a flag)")
            continue
        if name in TIMM_FLAGS:
            parts.append(f"{name} (timm train.py's flag; {TIMM_FLAGS[name]})")
            continue
        near = difflib.get_close_matches(
            "--" + name.lstrip("-").replace("-", "_"), known, n=1, cutoff=0.75
        )
        parts.append(name + (f" (did you mean {near[0]}?)" if near else ""))
    fixed = any("did you mean" in part or "timm train.py" in part for part in parts)
    hint = (
        ""
        if fixed
        # a typo or a timm flag: the fix is the flag, not the escape
        else (
            " (to let a platform's own arguments through: "
            f"{IGNORE_ARGS}={wrong[0][0].split('=', 1)[0]})"
        )
    )
    raise ConfigError(
        f"unknown argument{'s' * (len(parts) > 1)} {', '.join(parts)}; see "
        f"{parser.prog} --help{hint}"
    )


def cmd_train(argv: list[str]) -> int:
    cfg = parse_train_args(argv)
    from .api import run_training  # heavy imports after the arguments are known to be good

    run_training(cfg, taken=cfg.taken)
    return EXIT_OK


def cmd_evaluate(argv):
    from .commands.evaluate import main_evaluate

    return main_evaluate(argv)


def cmd_predict(argv):
    from .commands.predict import main_predict

    return main_predict(argv)


def cmd_preflight(argv):
    from .commands.preflight import main_preflight

    return main_preflight(argv)


def cmd_smoke(argv):
    from .commands.smoke import main_smoke

    return main_smoke(argv)


COMMANDS = {
    "train": cmd_train,
    "evaluate": cmd_evaluate,
    "predict": cmd_predict,
    "preflight": cmd_preflight,
    "smoke": cmd_smoke,
}


def main(argv: list[str] | None = None) -> int:
    # Before torch is imported (c10/core/impl/alloc_cpu.cpp reads it once, at the first allocation),
    # here for both `python -m accel_train` and the `accel-train` script (pyproject: this function):
    # CPU tensors of 2 MiB and more are allocated 2 MiB-aligned with madvise(MADV_HUGEPAGE), so a
    # fresh batch of floats (38 MB at 64 x 224 px, above glibc's 32 MiB mmap limit: new pages every
    # step) takes a few huge-page faults instead of ~9,400 small ones. Where the kernel's
    # transparent huge pages are "never" it changes nothing. THP_MEM_ALLOC_ENABLE=0 turns it off.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", level=logging.INFO
    )
    logging.getLogger("accelerate").setLevel(logging.WARNING)  # its per-file save/load chatter
    command = argv.pop(0) if argv and argv[0] in COMMANDS else "train"
    code = status_of(lambda: COMMANDS[command](argv))
    exit_rank(code)
    return code
