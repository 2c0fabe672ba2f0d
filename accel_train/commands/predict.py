"""`accel-train predict`: top-k classes with probabilities for image files or folders, from a
finished run's model or one of its checkpoints.

    accel-train predict --checkpoint output_dir cat.png ship.jpg
    accel-train predict --checkpoint output_dir/checkpoints/step_00000042 my_photos/
        # a checkpoint, a folder
    accel-train predict --checkpoint output_dir --format json my_photos/
        # one JSON object per image (or csv)
    accel-train predict --checkpoint output_dir --held_out   # the files a --val_split run held out
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import torch

from ..errors import EXIT_BAD_INPUT, ConfigError
from ..parser import Parser
from .evaluate import given_normalisation, load_exported, model_code_flags, normalisation_flags


def load_image(path, info) -> torch.Tensor:
    """An image file -> normalised (3, S, S) float tensor, exactly as the model saw its data
    (decode_image)."""
    from torchvision.transforms.v2 import functional as TF

    from ..data import DataError, decode_image

    try:
        x = decode_image(path, info.image_size, info.crop_pct)
    except DataError as e:
        raise ConfigError(f"cannot read image: {e}") from None
    return TF.normalize(x.float() / 255, list(info.mean), list(info.std))


def image_paths(args: list[str]) -> list[Path]:
    """Files as given; a folder gives its image files (extensions Pillow claims, recursively,
    sorted)."""
    from ..data.folders import _image_extensions

    extensions, out = _image_extensions(), []
    for arg in map(Path, args):
        if arg.is_dir():
            out += sorted(
                f
                for f in arg.rglob("*")
                if f.is_file() and not f.name.startswith(".") and f.suffix.lower() in extensions
            )
        else:
            out.append(arg)
    return out


def held_out_files(checkpoint, info) -> list[Path]:
    """The files of train/ that the run which wrote `checkpoint` held out (--val_split), as it
    chose them."""
    from ..config.train_config import TrainConfig
    from ..data.folders import held_out, image_folder_splits, scan_split
    from .evaluate import recorded_run

    run = recorded_run(checkpoint)
    if not run.get("val_split"):
        raise ConfigError(
            f"--held_out: the run of {checkpoint} held nothing out (its config.yaml "
            "has no --val_split); pass image files or folders"
        )
    train = image_folder_splits(run["data_dir"], True, run["val_split"])[0]
    classes, files, labels = scan_split(train, info.classes)
    seed = run.get("seed", TrainConfig.seed)
    return held_out(train, classes, files, labels, run["val_split"], seed)[1][0]


def predict_lines(model, info, paths: list[Path], top: int, batch: int = 64):
    """Yields (path, [(class, probability), ...] or None, error or None) per image, in order: a file
    that cannot be read is named, and the others are still predicted. `info`: the DataInfo of
    model_config.json (+ --mean/--std)."""
    classes = info.classes
    for start in range(0, len(paths), batch):
        chunk, good, errors = paths[start : start + batch], [], {}
        for path in chunk:
            try:
                good.append((path, load_image(path, info)))
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
            yield path, [(classes[i], v) for v, i in zip(values.tolist(), indices.tolist())], None


class Printer:
    """--format: 'text' (`file: class p%, ...`; an unreadable file named on stderr), 'json' (one
    object per line: file and top classes with probabilities, or file and error) or 'csv' (a header,
    then a row per file: its top classes and probabilities, or its error; fields quoted by the csv
    module where they hold a comma or a quote)."""

    def __init__(self, form: str, top: int):
        self.form, self.top = form, top
        self.csv = csv.writer(sys.stdout, lineterminator="\n") if form == "csv" else None
        if self.csv:
            self.csv.writerow(
                [
                    "file",
                    *(f"{k}_{n}" for n in range(1, top + 1) for k in ("class", "probability")),
                    "error",
                ]
            )

    def __call__(self, path: Path, top: list | None, error: str | None) -> None:
        if self.form == "text":
            if error:
                print(error, file=sys.stderr, flush=True)
            else:
                print(f"{path}: " + ", ".join(f"{name} {p:.1%}" for name, p in top), flush=True)
        elif self.form == "json":
            record = (
                {"error": error}
                if error
                else {"top": [{"class": name, "probability": round(p, 6)} for name, p in top]}
            )
            # (狗, not \u72d7)
            print(json.dumps({"file": str(path), **record}, ensure_ascii=False), flush=True)
        else:
            cells = [c for name, p in top or [] for c in (name, f"{p:.6f}")]
            self.csv.writerow([str(path), *cells, *[""] * (2 * self.top - len(cells)), error or ""])
            sys.stdout.flush()


def main_predict(argv: list[str]) -> int:
    p = Parser(
        prog="accel-train predict",
        description=(
            "Top-5 classes (the names of the data set the model was trained on) "
            "with probabilities for each image, from a finished run's model."
        ),
    )
    p.add_argument(
        "--checkpoint",
        required=True,
        help=(
            "output directory of a finished run, or a checkpoint folder "
            "(<output_dir>/checkpoints/step_N)"
        ),
    )
    p.add_argument(
        "--top",
        type=int,
        default=5,
        metavar="K",
        help="the K most likely classes shown for each image",
    )
    p.add_argument(
        "--format",
        default="text",
        choices=("text", "json", "csv"),
        help=(
            "text: 'file: class p%%, ...' per image; json: one object per line "
            '({"file", "top": [{"class", "probability"}, ...]} or '
            '{"file", "error"}); csv: a header, then a row per image '
            "(file, class_1, probability_1, ..., error), quoted where a field needs it"
        ),
    )
    p.add_argument(
        "images",
        nargs="*",
        help=(
            "image files or folders of them (resized to the "
            "model's input size, centre crop); an unreadable file is named and the others "
            "are still predicted (exit 2 at the end)"
        ),
    )
    p.add_argument(
        "--held_out",
        action="store_true",
        help=(
            "the files a --val_split run held out "
            "of its train/ (its config.yaml: folder, fraction, seed), in place of images"
        ),
    )
    model_code_flags(p)
    normalisation_flags(p)
    args = p.parse_args(argv)
    from ..data import DataInfo

    model, meta = load_exported(
        args.checkpoint, args.ema, args.trust_model_code, args.model, args.best
    )
    info = DataInfo.from_model_config(meta, *given_normalisation(args))
    if bool(args.images) == args.held_out:
        raise ConfigError(
            "pass image files or folders, or --held_out (the files the run held out), one of them"
        )
    paths = held_out_files(args.checkpoint, info) if args.held_out else image_paths(args.images)
    if not paths:
        raise ConfigError(f"no image files in {' '.join(args.images)}")
    bad, say = [], Printer(args.format, min(args.top, len(meta["classes"])))
    for path, top, error in predict_lines(model, info, paths, args.top):
        bad += [path] if error else []
        say(path, top, error)
    if bad:
        print(
            f"{len(bad)} of {len(paths)} images could not be read: {', '.join(map(str, bad[:10]))}"
            + (f" and {len(bad) - 10} more" if len(bad) > 10 else ""),
            file=sys.stderr,
            flush=True,
        )
        return EXIT_BAD_INPUT
    return 0
