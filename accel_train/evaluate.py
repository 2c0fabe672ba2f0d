"""Evaluation: the function the training loop calls each epoch, and `accel-train evaluate` / `predict`,
which use a finished run's model.safetensors and the data set's facts in its model_config.json.

    accel-train evaluate --checkpoint output_dir --data cifar10 --data_dir input_dir
    accel-train evaluate --checkpoint output_dir --data imagefolder --data_dir my_images   # reads val/ only
    accelerate launch --config_file accelerate_configs/2proc_cpu.yaml -m accel_train evaluate \
        --checkpoint output_dir ...
    accel-train predict --checkpoint output_dir cat.png ship.jpg
    accel-train predict --checkpoint output_dir/checkpoints/step_00000042 my_photos/   # a checkpoint, a folder
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from .checkpoint import EMA_FILE, MODEL_CONFIG_FILE, MODEL_FILE
from .config import EXIT_BAD_INPUT, ConfigError, Parser, TrainConfig
from .preempt import AgreedChecks


@torch.no_grad()
def evaluate(accelerator, model, loader, data, tta: bool = False,
             stop=None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Predictions and labels for the whole evaluation split, gathered over ranks, padding removed.
    `stop` (training): a StopRequest the ranks agree on every few seconds of batches (AgreedChecks); None is
    returned on every rank when it fires."""
    model.eval()
    all_preds, all_labels = [], []
    checks = AgreedChecks(stop) if stop is not None else None
    size = None  # every batch is run at the first one's size: one input shape, one compiled graph
    for i, batch in enumerate(loader):
        if checks is not None and checks.due(i) and checks.agree(accelerator, i):
            return None
        x, y = data.inputs(batch, train=False)
        size = size or len(x)
        x = pad_batch(x, size)
        with accelerator.autocast():
            scores = model(x).float().softmax(1)
            if tta:
                scores = scores + model(x.flip(3)).float().softmax(1)
            scores = scores[:len(y)]  # the padding rows go (eval mode: no row depends on another)
        preds, y = accelerator.gather_for_metrics((scores.argmax(1), y))
        all_preds.append(preds)
        all_labels.append(y)
    return torch.cat(all_preds).cpu(), torch.cat(all_labels).cpu()


def pad_batch(x: torch.Tensor, size: int) -> torch.Tensor:
    """`x` with its last row repeated up to `size` rows, in its memory format (a shorter last batch would
    make torch.compile compile another graph)."""
    if len(x) >= size:
        return x
    fmt = torch.channels_last if x.dim() == 4 and not x.is_contiguous() and \
        x.is_contiguous(memory_format=torch.channels_last) else torch.contiguous_format
    padded = torch.empty((size, *x.shape[1:]), dtype=x.dtype, device=x.device).contiguous(memory_format=fmt)
    padded[:len(x)] = x
    padded[len(x):] = x[-1:]
    return padded


def load_exported(checkpoint, ema: bool = False) -> tuple[torch.nn.Module, dict]:
    """model.safetensors (or the EMA's) + model_config.json -> (eval-mode model, config). `checkpoint`: a finished
    run's output dir, or one of its checkpoints/step_N folders (each carries the model's model_config.json)."""
    from safetensors.torch import load_file

    from .model import create_model, plain_state_dict
    root = Path(checkpoint)
    weights = root / ((EMA_FILE if (root / EMA_FILE).is_file() else "model_ema.safetensors") if ema else MODEL_FILE)
    missing = [name for name, path in ((MODEL_CONFIG_FILE, root / MODEL_CONFIG_FILE), (weights.name, weights))
               if not path.is_file()]
    if missing:
        raise ConfigError(f"{root} has no {' and no '.join(missing)}; pass the --output_dir of a finished run or "
                          "one of its checkpoints/step_N folders" + (" trained with --ema" if ema else ""))
    meta = json.loads((root / MODEL_CONFIG_FILE).read_text())
    model = create_model(meta["architecture"], meta["stem"], num_classes=meta["num_classes"],
                         **meta.get("model_kwargs", {}))
    try:
        model.load_state_dict(plain_state_dict(load_file(weights)))  # (a checkpoint's: written from the prepared model)
    except Exception as e:
        raise ConfigError(f"{weights} does not fit {meta['architecture']} ({str(e).splitlines()[0][:200]})") from None
    return model.eval(), meta


def main_evaluate(argv: list[str]) -> int:
    p = Parser(prog="accel-train evaluate", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
               description="Accuracy and per-class accuracy of a finished run's model on the evaluation split "
                           "only; classes, input size and mean/std come from its model_config.json; runs on "
                           "several ranks under accelerate launch (gather_for_metrics).")
    defaults = TrainConfig()
    p.add_argument("--checkpoint", required=True, help="output directory of a finished run, or a checkpoint folder "
                   "(<output_dir>/checkpoints/step_N)")
    p.add_argument("--data", default=None, choices=("cifar10", "imagefolder", "random"),
                   help="default: the data set the model was trained on")
    p.add_argument("--data_dir", "--data_url", default=defaults.data_dir)
    p.add_argument("--test_samples", type=int, default=None, help="only the first N test samples")
    p.add_argument("--batch_size", type=int, default=256, help="per process")
    p.add_argument("--pipeline", default=defaults.pipeline, choices=("auto", "device", "cpu"))
    p.add_argument("--num_workers", type=int, default=defaults.num_workers, help="DataLoader workers (cpu pipeline)")
    p.add_argument("--tta", action="store_true", help="horizontal-flip test-time augmentation")
    p.add_argument("--ema", action="store_true", help="evaluate model_ema.safetensors")
    p.add_argument("--seed", type=int, default=defaults.seed, help="seed of the random data set")
    args = p.parse_args(argv)

    from accelerate import Accelerator
    from accelerate.logging import get_logger
    from accelerate.utils import is_npu_available

    from accelerate.utils import broadcast_object_list

    from .data import DataInfo, build_data, device_budget
    model, meta = load_exported(args.checkpoint, args.ema)
    info = DataInfo.from_model_config(meta)
    data_name = args.data or meta.get("data", "cifar10")
    cfg = TrainConfig(data=data_name, data_dir=args.data_dir, test_samples=args.test_samples, seed=args.seed,
                      batch_size=args.batch_size, pipeline=args.pipeline, num_workers=args.num_workers,
                      image_size=info.image_size if data_name != "cifar10" else None)
    accelerator = Accelerator(cpu=not (torch.accelerator.is_available() or is_npu_available()))
    budget = broadcast_object_list([device_budget(cfg, accelerator.device)])[0]  # one pipeline for all ranks
    data = build_data(cfg, accelerator.device, info=info, eval_only=True, budget=budget)
    model, test_loader = accelerator.prepare(model, data.test_loader)
    preds, labels = evaluate(accelerator, model, test_loader, data, args.tta)
    log = get_logger("accel_train")
    acc = (preds == labels).float().mean().item()
    width = max(12, *(len(c) for c in info.classes))
    lines = [f"{meta['architecture']} ({meta['stem']} stem) from {args.checkpoint}"
             + (" [EMA]" if args.ema else "") + (" [flip TTA]" if args.tta else "")
             + f": test accuracy {acc:.2%} on {labels.numel()} samples ({accelerator.num_processes} process(es))",
             f"{'class':{width}s} {'samples':>8s} {'accuracy':>9s}"]
    for c, name in enumerate(info.classes):
        mask = labels == c
        n = int(mask.sum())
        accuracy = f"{(preds[mask] == c).float().mean().item():9.2%}" if n else f"{'-':>9s}"
        lines.append(f"{name:{width}s} {n:8d} {accuracy}")
    if accelerator.is_main_process:
        print("\n".join(lines), flush=True)
    log.info(f"evaluated {labels.numel()} samples; {data.describe()}", main_process_only=True)
    accelerator.end_training()
    return 0


def load_image(path, meta: dict) -> torch.Tensor:
    """An image file -> normalised (3, S, S) float tensor, exactly as the model saw its data (decode_image)."""
    from torchvision.transforms.v2 import functional as TF

    from .data import DataError, DataInfo, decode_image
    info = DataInfo.from_model_config(meta)
    try:
        x = decode_image(path, info.image_size)
    except DataError as e:
        raise ConfigError(f"cannot read image: {e}") from None
    return TF.normalize(x.float() / 255, list(info.mean), list(info.std))


def image_paths(args: list[str]) -> list[Path]:
    """Files as given; a folder gives its image files (extensions Pillow claims, recursively, sorted)."""
    from .data import _image_extensions
    extensions, out = _image_extensions(), []
    for arg in map(Path, args):
        if arg.is_dir():
            out += sorted(f for f in arg.rglob("*") if f.is_file() and not f.name.startswith(".")
                          and f.suffix.lower() in extensions)
        else:
            out.append(arg)
    return out


def predict_lines(model, meta: dict, paths: list[Path], top: int, batch: int = 64):
    """Yields (path, 'class p%, ...' or None, error or None) per image, in order: a file that cannot be read is
    named, and the others are still predicted."""
    classes = meta["classes"]
    for start in range(0, len(paths), batch):
        chunk, good, errors = paths[start:start + batch], [], {}
        for path in chunk:
            try:
                good.append((path, load_image(path, meta)))
            except ConfigError as e:
                errors[path] = str(e)
        probs = iter(())
        if good:
            with torch.no_grad():
                probs = iter(model(torch.stack([x for _, x in good])).float().softmax(1))
        for path in chunk:
            if path in errors:
                yield path, None, errors[path]
                continue
            values, indices = next(probs).topk(min(top, len(classes)))
            yield path, ", ".join(f"{classes[i]} {v:.1%}" for v, i in zip(values.tolist(), indices.tolist())), None


def main_predict(argv: list[str]) -> int:
    p = Parser(prog="accel-train predict", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
               description="Top-5 classes (the names of the data set the model was trained on) with "
                           "probabilities for each image, from a finished run's model.")
    p.add_argument("--checkpoint", required=True, help="output directory of a finished run, or a checkpoint folder "
                   "(<output_dir>/checkpoints/step_N)")
    p.add_argument("--ema", action="store_true", help="use model_ema.safetensors")
    p.add_argument("--top", type=int, default=5)
    p.add_argument("images", nargs="+", help="image files or folders of them (resized to the model's input size, "
                   "centre crop); an unreadable file is named and the others are still predicted (exit 2 at the end)")
    args = p.parse_args(argv)
    model, meta = load_exported(args.checkpoint, args.ema)
    paths = image_paths(args.images)
    if not paths:
        raise ConfigError(f"no image files in {' '.join(args.images)}")
    bad = []
    for path, line, error in predict_lines(model, meta, paths, args.top):
        if error:
            bad.append(path)
            print(error, file=sys.stderr, flush=True)
        else:
            print(f"{path}: {line}", flush=True)
    if bad:
        print(f"{len(bad)} of {len(paths)} images could not be read: {', '.join(map(str, bad[:10]))}"
              + (f" and {len(bad) - 10} more" if len(bad) > 10 else ""), file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    return 0
