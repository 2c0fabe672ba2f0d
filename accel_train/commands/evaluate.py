"""`accel-train evaluate`: a finished run's model.safetensors (or a checkpoint folder) on the
evaluation split, with the data set's facts from its model_config.json; on several ranks under
accelerate launch.

    accel-train evaluate --checkpoint output_dir --data cifar10 --data_dir input_dir
    accel-train evaluate --checkpoint output_dir --data imagefolder --data_dir my_images
        # reads val/ only
    accel-train evaluate --checkpoint output_dir   # a --val_split run: the train/ files held out
    accelerate launch --config_file accelerate_configs/2proc_cpu.yaml -m accel_train evaluate \\
        --checkpoint output_dir ...
"""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import torch

from ..config.train_config import TrainConfig
from ..errors import ConfigError
from ..files import BEST_FILE, CONFIG_FILE, EMA_EXPORT_FILE, EMA_FILE, MODEL_CONFIG_FILE, MODEL_FILE
from ..model.own_model import allow_import, same_callable, search_code_dir
from ..parser import Parser
from ..training.evaluate import evaluate

# evaluate's batch where the run's is unknown. Memory: 2 ranks at 256 measured 1.35 GiB per rank
# (resnet18, cifar stem, 32 px) and 2.6 GiB (imagenet stem, 224 px) on a 24 GiB machine; the run's
# own training batch, the default, fit with gradients.
EVAL_BATCH = 256


def load_exported(
    checkpoint, ema: bool = False, trust: bool = False, named: str | None = None, best: bool = False
) -> tuple[torch.nn.Module, dict]:
    """model.safetensors (the EMA's with `ema`, model_best.safetensors with `best`) +
    model_config.json -> (eval-mode model, config). `checkpoint`: a finished run's output dir, one
    of its checkpoints/step_N folders (each carries the model's model_config.json), or one of the
    run's .safetensors files. A model built by code (an import path) is imported only with `trust`
    (--trust_model_code) or `named` the same (--model)."""
    from safetensors.torch import load_file

    from ..model.create import create_model, plain_state_dict

    root = Path(checkpoint)
    # a weights file of the run (model_best's, ...)
    if root.suffix == ".safetensors" and not ema and not best:
        root, weights = root.parent, root
    else:
        weights = root / (
            (EMA_FILE if (root / EMA_FILE).is_file() else EMA_EXPORT_FILE)
            if ema
            else BEST_FILE
            if best
            else MODEL_FILE
        )
    missing = [
        name
        for name, path in ((MODEL_CONFIG_FILE, root / MODEL_CONFIG_FILE), (weights.name, weights))
        if not path.is_file()
    ]
    if missing:
        raise ConfigError(
            f"{root} has no {' and no '.join(missing)}; pass the --output_dir of a "
            "finished run or one of its checkpoints/step_N folders"
            + (" trained with --ema" if ema else "")
            + (" (model_best.safetensors: a run that evaluated at least one epoch)" if best else "")
        )
    meta = json.loads((root / MODEL_CONFIG_FILE).read_text())
    # a model given to train() that no import path rebuilds
    if not meta.get("architecture") and not named:
        raise ConfigError(
            f"{root / MODEL_CONFIG_FILE} records no architecture (the model was "
            "given to train() and its import path does not rebuild it); pass "
            "--model module.path:callable that builds it, called "
            f"with num_classes and {meta.get('model_kwargs') or {}}"
        )
    if same_callable(named, meta.get("architecture")):
        meta["architecture"] = named  # (its importable name)
    if named and meta.get("architecture") and named != meta["architecture"]:
        raise ConfigError(
            f"--model {named}, but {root / MODEL_CONFIG_FILE} says the model is "
            f"{meta['architecture']}; drop --model or name that one"
        )
    arch = named or meta["architecture"]
    allow_import(arch, trust, named, str(root / MODEL_CONFIG_FILE))
    search_code_dir(meta.get("code_dir"))  # (the training script's folder: its own code)
    # (a model of a fixed input size: built for the run's)
    model = create_model(
        arch,
        meta["stem"],
        meta["num_classes"],
        int(meta["input_size"][-1]),
        **meta.get("model_kwargs", {}),
    )
    try:
        state = load_file(weights)
    # (safetensors' own error: a header or data cut short, not a safetensors file)
    except Exception as e:
        raise ConfigError(
            f"{weights} is damaged: not a complete safetensors file "
            f"({str(e).splitlines()[0][:200]}); train again or take a checkpoint's "
            "copy"
        ) from None
    try:
        # (a checkpoint's: written from the prepared model)
        model.load_state_dict(plain_state_dict(state))
    except Exception as e:
        raise ConfigError(
            f"{weights} does not fit {arch} ({str(e).splitlines()[0][:200]})"
        ) from None
    return model.eval(), meta


def normalisation_flags(p) -> None:
    """--mean/--std: over the recorded ones; needed where the model was trained on your own Dataset
    whose normalisation was not seen (model_config.json records null)."""
    for name in ("mean", "std"):
        p.add_argument(
            f"--{name}",
            default=None,
            help=(
                f"R,G,B {name} the images are normalised with (default: "
                "model_config.json's; required where it records none: a model trained on "
                "your own Dataset)"
            ),
        )


def given_normalisation(args) -> tuple:
    return TrainConfig(mean=args.mean, std=args.std).normalisation()


def recorded_run(checkpoint) -> dict:
    """The config.yaml of the run that wrote `checkpoint` (an output dir, or one of its
    checkpoints/step_N), {} if none: where its data came from."""
    import yaml

    root = (
        Path(checkpoint).parent if Path(checkpoint).suffix == ".safetensors" else Path(checkpoint)
    )
    path = (
        root.parent.parent / CONFIG_FILE
        if root.parent.name == "checkpoints"
        else root / CONFIG_FILE
    )
    try:
        recorded = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return recorded if isinstance(recorded, dict) else {}


def model_code_flags(p) -> None:
    """--trust_model_code / --model: what allows importing the model code a model_config.json names;
    --ema / --best: which of the run's weights."""
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--ema", action="store_true", help="the EMA weights (model_ema.safetensors; --ema runs)"
    )
    which.add_argument(
        "--best",
        action="store_true",
        help=(
            "the best epoch's weights (model_best.safetensors); "
            "--checkpoint may also name a .safetensors file of the run"
        ),
    )
    p.add_argument(
        "--trust_model_code",
        action="store_true",
        help=(
            "import the model code (module.path:callable) "
            "that the checkpoint's model_config.json names: it runs that code"
        ),
    )
    p.add_argument(
        "--model",
        default=None,
        help=(
            "the model's import path, as model_config.json names it: allows that "
            "import as --trust_model_code does (where model_config.json names none: the "
            "code that builds it)"
        ),
    )


def columns(text: str) -> int:
    """The columns `text` takes in a terminal: a wide character (CJK, fullwidth forms) takes two."""
    return sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in text)


def main_evaluate(argv: list[str]) -> int:
    p = Parser(
        prog="accel-train evaluate",
        description=(
            "Accuracy and per-class accuracy of a finished run's model on the "
            "evaluation split only; classes, input size and mean/std come from its "
            "model_config.json; runs on several ranks under accelerate launch "
            "(gather_for_metrics)."
        ),
    )
    defaults = TrainConfig()
    p.add_argument(
        "--checkpoint",
        required=True,
        help=(
            "output directory of a finished run, or a checkpoint folder "
            "(<output_dir>/checkpoints/step_N)"
        ),
    )
    p.add_argument(
        "--data",
        default=None,
        choices=("cifar10", "imagefolder", "random"),
        help="default: the data set the model was trained on",
    )
    p.add_argument(
        "--data_dir",
        "--data_url",
        default=None,
        help=f"default: the run's (its config.yaml), else {defaults.data_dir}",
    )
    p.add_argument("--test_samples", type=int, default=None, help="only the first N test samples")
    p.add_argument(
        "--batch_size",
        type=int,
        default=None,
        help=(
            "per process; default: the run's training batch "
            f"(its config.yaml: it fit in memory with gradients), else {EVAL_BATCH}"
        ),
    )
    p.add_argument(
        "--pipeline", default=defaults.pipeline, choices=("auto", "device", "cpu", "cache")
    )
    p.add_argument(
        "--num_workers",
        type=int,
        default=defaults.num_workers,
        help="DataLoader workers (cpu pipeline); default: the cores per process",
    )
    p.add_argument("--tta", action="store_true", help="horizontal-flip test-time augmentation")
    p.add_argument("--seed", type=int, default=defaults.seed, help="seed of the random data set")
    model_code_flags(p)
    normalisation_flags(p)
    args = p.parse_args(argv)

    from accelerate import Accelerator
    from accelerate.logging import get_logger

    from ..data import DataInfo, build_data, device_budget
    from ..platform.hardware import has_accelerator
    from ..platform.ranks import on_every_rank, rank0s

    model, meta = load_exported(
        args.checkpoint, args.ema, args.trust_model_code, args.model, args.best
    )
    info = DataInfo.from_model_config(meta, *given_normalisation(args))
    data_name, run = args.data or meta.get("data", "cifar10"), recorded_run(args.checkpoint)
    if data_name == "dataset":
        raise ConfigError(
            f"the model was trained on your own Dataset ({meta.get('dataset')}) "
            "through train(); pass --data imagefolder or cifar10 with --data_dir for "
            "files to evaluate it on (read as accel_train reads them: shorter side "
            "resized, centre crop, the recorded mean/std)"
        )
    data_dir = (
        args.data_dir
        or (run.get("data_dir") if run.get("data") == data_name else None)
        or defaults.data_dir
    )
    # the run's own folder: its --val_split's held-out files (by the run's seed), what it evaluated
    own = Path(data_dir).resolve() == Path(str(run.get("data_dir"))).resolve()
    own = own and data_name == run.get("data") == "imagefolder"
    val_split = run.get("val_split") if own else None
    seed = run.get("seed", args.seed) if val_split else args.seed
    cfg = TrainConfig(
        data=data_name,
        data_dir=data_dir,
        test_samples=args.test_samples,
        seed=seed,
        batch_size=args.batch_size or run.get("batch_size") or EVAL_BATCH,
        pipeline=args.pipeline,
        num_workers=args.num_workers,
        val_split=val_split,
        image_size=info.image_size if data_name != "cifar10" else None,
    )
    accelerator = Accelerator(cpu=not has_accelerator())
    # one pipeline for all ranks
    budget = rank0s(device_budget(cfg.device_data_mb, accelerator.device))
    # (on_every_rank: a bad folder on one rank is one line on every rank, not a wait in the next
    # collective; its gather is also the point past which a machine's other ranks may map the
    # decoded cache its local main writes)
    data = on_every_rank(
        accelerator, build_data, cfg, accelerator.device, info=info, eval_only=True, budget=budget
    )
    model, test_loader = accelerator.prepare(model, data.test_loader)
    evaluated = evaluate(accelerator, model, test_loader, data, args.tta)
    preds, labels = evaluated.preds, evaluated.labels
    log = get_logger("accel_train")
    acc, row = evaluated.accuracy(), evaluated.metrics(len(info.classes))
    width = max(12, *(columns(c) for c in info.classes))
    lines = [
        f"{meta['architecture'] or args.model} ({meta['stem']} stem) from {args.checkpoint}"
        + (" [EMA]" if args.ema else "")
        + (" [best epoch]" if args.best else "")
        + (" [flip TTA]" if args.tta else "")
        + f": test accuracy {acc:.2%} on {labels.numel()} samples "
        f"({accelerator.num_processes} process(es)); loss {row['test_loss']:.4f}"
        + (f", top-5 {row['test_top5']:.2%}" if "test_top5" in row else ""),
        f"{'class':{width}s} {'samples':>8s} {'accuracy':>9s}",
    ]
    for c, name in enumerate(info.classes):
        mask = labels == c
        n = int(mask.sum())
        accuracy = f"{(preds[mask] == c).float().mean().item():9.2%}" if n else f"{'-':>9s}"
        lines.append(f"{name}{' ' * (width - columns(name))} {n:8d} {accuracy}")
    if accelerator.is_main_process:
        print("\n".join(lines), flush=True)
    log.info(
        f"evaluated {labels.numel()} samples, {cfg.batch_size} per process and batch"
        + (
            ""
            if args.batch_size
            else " (the run's training batch)"
            if run.get("batch_size")
            else ""
        )
        + f"; {data.describe()}",
        main_process_only=True,
    )
    accelerator.end_training()
    return 0
