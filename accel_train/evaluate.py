"""`accel-train evaluate` and `accel-train predict`: use a finished run's model.safetensors.

    accel-train evaluate --checkpoint output_dir --data cifar10 --data_dir input_dir
    accelerate launch --config_file accelerate_configs/2proc_cpu.yaml -m accel_train evaluate \
        --checkpoint output_dir ...
    accel-train predict --checkpoint output_dir cat.png ship.jpg
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from .checkpoint import MODEL_CONFIG_FILE, MODEL_FILE
from .cli import Parser
from .config import ConfigError, TrainConfig


def load_exported(checkpoint, ema: bool = False) -> tuple[torch.nn.Module, dict]:
    """model.safetensors (or model_ema.safetensors) + model_config.json -> (eval-mode model, config)."""
    from safetensors.torch import load_file

    from .model import create_model
    root = Path(checkpoint)
    weights = root / ("model_ema.safetensors" if ema else MODEL_FILE)
    if not (root / MODEL_CONFIG_FILE).is_file() or not weights.is_file():
        raise ConfigError(f"{root} has no {MODEL_CONFIG_FILE} and {weights.name}; pass the --output_dir of a "
                          "finished run" + (" trained with --ema" if ema else ""))
    meta = json.loads((root / MODEL_CONFIG_FILE).read_text())
    model = create_model(meta["architecture"], meta["stem"], num_classes=meta["num_classes"],
                         **meta.get("model_kwargs", {}))
    try:
        model.load_state_dict(load_file(weights))
    except Exception as e:
        raise ConfigError(f"{weights} does not fit {meta['architecture']} ({str(e).splitlines()[0][:200]})") from None
    return model.eval(), meta


def main_evaluate(argv: list[str]) -> int:
    p = Parser(prog="accel-train evaluate", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
               description="Accuracy and per-class accuracy of a finished run's model on the test split; "
                           "runs on several ranks under accelerate launch (gather_for_metrics).")
    defaults = TrainConfig()
    p.add_argument("--checkpoint", required=True, help="output directory of a finished run")
    p.add_argument("--data", default="cifar10", choices=("cifar10", "random"))
    p.add_argument("--data_dir", "--data_url", default=defaults.data_dir)
    p.add_argument("--test_samples", type=int, default=None, help="only the first N test samples")
    p.add_argument("--batch_size", type=int, default=256, help="per process")
    p.add_argument("--tta", action="store_true", help="horizontal-flip test-time augmentation")
    p.add_argument("--ema", action="store_true", help="evaluate model_ema.safetensors")
    p.add_argument("--seed", type=int, default=defaults.seed, help="seed of the random data set")
    args = p.parse_args(argv)

    from accelerate.logging import get_logger

    from .config import CIFAR10_CLASSES
    from .data import build_data
    from .loop import evaluate, make_accelerator
    model, meta = load_exported(args.checkpoint, args.ema)
    cfg = TrainConfig(data=args.data, data_dir=args.data_dir, test_samples=args.test_samples, seed=args.seed,
                      batch_size=args.batch_size, train_samples=args.batch_size * 64)
    accelerator = make_accelerator(cfg)
    data = build_data(cfg, accelerator.device)
    model, test_loader = accelerator.prepare(model, data.test_loader)
    preds, labels = evaluate(accelerator, model, test_loader, data, args.tta)
    log = get_logger("accel_train")
    acc = (preds == labels).float().mean().item()
    lines = [f"{meta['architecture']} ({meta['stem']} stem) from {args.checkpoint}"
             + (" [EMA]" if args.ema else "") + (" [flip TTA]" if args.tta else "")
             + f": test accuracy {acc:.2%} on {labels.numel()} samples ({accelerator.num_processes} process(es))",
             f"{'class':12s} {'samples':>8s} {'accuracy':>9s}"]
    for c, name in enumerate(meta.get("classes", CIFAR10_CLASSES)):
        mask = labels == c
        n = int(mask.sum())
        accuracy = f"{(preds[mask] == c).float().mean().item():9.2%}" if n else f"{'-':>9s}"
        lines.append(f"{name:12s} {n:8d} {accuracy}")
    if accelerator.is_main_process:
        print("\n".join(lines), flush=True)
    log.info(f"evaluated {labels.numel()} samples", main_process_only=True)
    accelerator.end_training()
    return 0


def load_image(path, meta: dict) -> torch.Tensor:
    """An image file -> normalised (3, 32, 32) float tensor, as the model was trained."""
    from PIL import Image, UnidentifiedImageError
    from torchvision.transforms.v2 import functional as TF
    try:
        with Image.open(path) as img:
            img = img.convert("RGB")
            size = tuple(meta.get("input_size", [3, 32, 32])[1:])
            if img.size != size[::-1]:
                img = img.resize(size[::-1], Image.BICUBIC)
            x = TF.pil_to_tensor(img)
    except (OSError, UnidentifiedImageError) as e:
        raise ConfigError(f"cannot read image {path} ({e}); pass PNG/JPEG files") from None
    return TF.normalize(x.float() / 255, meta["mean"], meta["std"])


def main_predict(argv: list[str]) -> int:
    p = Parser(prog="accel-train predict", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
               description="Top-5 classes with probabilities for each image, from a finished run's model.")
    p.add_argument("--checkpoint", required=True, help="output directory of a finished run")
    p.add_argument("--ema", action="store_true", help="use model_ema.safetensors")
    p.add_argument("--top", type=int, default=5)
    p.add_argument("images", nargs="+", help="image files (resized to 32x32 if needed)")
    args = p.parse_args(argv)
    model, meta = load_exported(args.checkpoint, args.ema)
    classes = meta["classes"]
    batch = torch.stack([load_image(path, meta) for path in args.images])
    with torch.no_grad():
        probs = model(batch).float().softmax(1)
    k = min(args.top, probs.shape[1])
    for path, row in zip(args.images, probs):
        values, indices = row.topk(k)
        print(f"{path}: " + ", ".join(f"{classes[i]} {v:.1%}" for v, i in zip(values.tolist(), indices.tolist())))
    return 0
