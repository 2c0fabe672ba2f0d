"""accel_train next to timm's own train.py: same image folder, model, epochs, batch and lr, one CPU
process each.

    python bench/vs_timm.py /tmp/timm_train.py [--epochs 5 --batch_size 64 --lr 0.1 --size 64
        --repeats 2 --seeds 1,2,3]

timm's train.py is not part of this repository: take it from timm's repository (the version matching
the installed timm) and pass its path. Nothing is fetched at run time. The script writes a learnable
synthetic image folder (coloured shapes on noise, <root>/train/<class>/*.png and
<root>/validation/<class>/*.png), then runs, alternating, `python train.py` (timm) and `python -m
accel_train` (ours) on it, each with its own defaults otherwise, and prints wall time and accuracy
per epoch, the whole run's wall time, and the start-up cost (imports) of each.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CLASSES = ("circle", "square", "triangle", "cross")


def hue_colour(k: int, rng, hues: int = 4) -> np.ndarray:
    """RGB of a hue in the k-th of `hues` equal sectors of the colour wheel (saturation and value
    0.6-1)."""
    import colorsys

    rgb = colorsys.hsv_to_rgb(
        (k + rng.uniform(0.1, 0.9)) / hues, rng.uniform(0.6, 1), rng.uniform(0.6, 1)
    )
    return np.array(rgb) * 255


def draw(
    kind: str, size: int, rng, photos: bool = False, shape=(0.06, 0.3), hues: int = 4
) -> np.ndarray:
    """One image: a shape of a random colour, size and place on a noisy background of another
    colour. `photos`: a canvas of its own size and shape (each side 1-2x `size`) and a shape (its
    half-width) of `shape` (a fraction range) of its shorter side, anywhere: the object's scale and
    position vary as in photos. kind 'hueK': the class is the object's hue (sector K of `hues` of
    the colour wheel), any of the four shapes, on a grey background.
    """
    hue = int(kind[3:]) if kind.startswith("hue") else None
    if hue is not None:
        kind = CLASSES[rng.integers(len(CLASSES))]
    h, w = (
        (int(size * rng.uniform(1, 2)), int(size * rng.uniform(1, 2))) if photos else (size, size)
    )
    yy, xx = np.mgrid[:h, :w].astype(np.float32)
    r = rng.uniform(*shape) * min(h, w) if photos else rng.uniform(0.18, 0.35) * size
    cy, cx = rng.uniform(r, h - r), rng.uniform(r, w - r)
    dy, dx = yy - cy, xx - cx
    if kind == "circle":
        mask = dy**2 + dx**2 <= r**2
    elif kind == "square":
        mask = (abs(dy) <= r * 0.85) & (abs(dx) <= r * 0.85)
    elif kind == "triangle":
        mask = (dy <= r * 0.8) & (dy >= -r) & (abs(dx) <= (dy + r) * 0.6)
    else:
        mask = ((abs(dy) <= r * 0.25) | (abs(dx) <= r * 0.25)) & (abs(dy) <= r) & (abs(dx) <= r)
    bg, fg = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
    while np.abs(bg - fg).sum() < 150:
        fg = rng.uniform(0, 255, 3)
    if hue is not None:
        bg, fg = np.full(3, rng.uniform(40, 215)), hue_colour(hue, rng, hues)
    img = np.where(mask[..., None], fg, bg) + rng.normal(0, 12, (h, w, 3))
    return np.clip(img, 0, 255).astype(np.uint8)


def make_folder(
    root: Path,
    size: int,
    train_per_class: int,
    val_per_class: int,
    seed: int = 0,
    photos: bool = False,
    shape=(0.06, 0.3),
    classes=CLASSES,
) -> Path:
    from PIL import Image

    rng = np.random.default_rng(seed)
    for split, n in (("train", train_per_class), ("validation", val_per_class)):
        for kind in classes:
            folder = root / split / kind
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                Image.fromarray(draw(kind, size, rng, photos, shape, len(classes))).save(
                    folder / f"{i:05d}.png"
                )
    return root


def run_timed(cmd, env, cwd) -> tuple[float, list[tuple[float, str]]]:
    """Run cmd; (wall seconds, [(seconds since start, line)] of its output)."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd
    )
    lines = [(time.perf_counter() - start, line.rstrip()) for line in proc.stdout]
    if proc.wait() != 0:
        sys.exit(
            f"failed ({proc.returncode}): {' '.join(map(str, cmd))}\n"
            + "\n".join(text for _, text in lines[-40:])
        )
    return time.perf_counter() - start, lines


def lr_flag(args) -> list[str]:
    """--lr for both trainers, or nothing: each its own default."""
    return [] if args.lr == "default" else ["--lr", str(args.lr)]


def lr_arg(text: str):
    """--lr: 'default' or a number (argparse says which when it is neither)."""
    return text if text == "default" else float(text)


def timm_run(args, data: Path, out: Path, env, seed: int) -> dict:
    cmd = [
        sys.executable,
        args.timm_train,
        "--data-dir",
        str(data),
        "--model",
        args.model,
        "--num-classes",
        str(args.num_classes),
        "--img-size",
        str(args.size),
        "--epochs",
        str(args.epochs),
        "-b",
        str(args.batch_size),
        *lr_flag(args),
        "--device",
        "cpu",
        "--output",
        str(out),
        "--experiment",
        "timm",
        "--seed",
        str(seed),
    ]
    wall, lines = run_timed(cmd, env, out)
    # an epoch ends when its evaluation prints its last batch ("Test: [ N/N]")
    ends = [
        t
        for t, line in lines
        if (m := re.search(r"Test: \[\s*(\d+)/(\d+)\]", line)) and m[1] == m[2]
    ]
    with open(out / "timm" / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    first = next((t for t, line in lines if "Train: 0 [" in line), None)
    return dict(
        wall=wall, epoch_ends=ends, acc=[float(r["eval_top1"]) / 100 for r in rows], first_log=first
    )


def ours_run(args, data: Path, out: Path, env, seed: int) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "accel_train",
        "--data",
        "imagefolder",
        "--data_dir",
        str(data),
        "--model",
        args.model,
        "--stem",
        "imagenet",
        "--image_size",
        str(args.size),
        "--epochs",
        str(args.epochs),
        "--batch_size",
        str(args.batch_size),
        *lr_flag(args),
        "--output_dir",
        str(out / "ours"),
        "--seed",
        str(seed),
        *args.ours,
    ]
    wall, lines = run_timed(cmd, env, ROOT)
    ends = [t for t, line in lines if re.search(r"epoch \d+/\d+ step \d+:", line)]
    rows = [json.loads(line) for line in (out / "ours" / "metrics.jsonl").read_text().splitlines()]
    chosen = [
        line.split("INFO ", 1)[-1]
        for _, line in lines
        if "precision " in line or "memory format" in line
    ]
    return dict(wall=wall, epoch_ends=ends, acc=[r["test_acc"] for r in rows], chosen=chosen)


def import_time(modules: str, env) -> float:
    code = f"import time; t = time.perf_counter(); import {modules}; print(time.perf_counter() - t)"
    return float(
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            check=True,
        ).stdout
    )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("timm_train", help="path to timm's train.py (not committed here)")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument(
        "--lr",
        type=lr_arg,
        default=0.1,
        help=(
            "the peak lr given to both, or 'default': each trainer's own default "
            "(timm: 0.1 per 256 images of batch; ours: 0.2 per 256, docs/training.md)"
        ),
    )
    p.add_argument(
        "--size",
        type=int,
        default=64,
        help="image size (px) of the generated folder and of training",
    )
    p.add_argument("--train_per_class", type=int, default=500)
    p.add_argument("--val_per_class", type=int, default=100)
    p.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="runs of each per seed, alternating (the same seed: the same accuracy; for wall time)",
    )
    p.add_argument(
        "--seeds",
        default="42",
        help=(
            "training seeds, comma-separated: seed i trains both on a folder of its own, drawn from"
            " --data_seed + i (paired runs: the summary's mean difference and its error)"
        ),
    )
    p.add_argument(
        "--data_seed", type=int, default=0, help="the seed the (first) image folder is drawn from"
    )
    p.add_argument(
        "--model", default="resnet18", help="the timm model both train (timm's own stem in both)"
    )
    p.add_argument(
        "--photos",
        action="store_true",
        help=(
            "photo-like: canvases of varying size and shape, the shape "
            "a --shape fraction of the shorter side, anywhere (draw)"
        ),
    )
    p.add_argument(
        "--by_hue",
        action="store_true",
        help=(
            "the class is the object's hue (one of --hues sectors of the "
            "colour wheel), its shape any of the four: learnable in few epochs on a CPU"
        ),
    )
    p.add_argument(
        "--hues",
        type=int,
        default=4,
        help="--by_hue: the number of classes (sectors of the colour wheel)",
    )
    p.add_argument(
        "--shape",
        default="0.06,0.3",
        help="--photos: the shape's half-width, a range of fractions of the canvas's shorter side",
    )
    p.add_argument(
        "--ours", nargs=argparse.REMAINDER, default=[], help="extra accel_train flags (at the end)"
    )
    args = p.parse_args()
    classes = tuple(f"hue{k}" for k in range(args.hues)) if args.by_hue else CLASSES
    args.num_classes = len(classes)
    seeds = [int(s) for s in args.seeds.split(",")]

    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(
            ("ACCELERATE_", "MASTER_", "WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC")
        )
    }
    env.update(PYTHONUNBUFFERED="1", TQDM_DISABLE="1", PYTHONPATH=str(ROOT))
    photos = (
        f"photo-like (shape {args.shape} of the shorter side), each side 1-2x "
        if args.photos
        else ""
    )
    print(
        f"# data: {len(classes)} classes x ({args.train_per_class} train + {args.val_per_class}"
        " val) PNG,"
        f" {'classes by hue, ' if args.by_hue else ''}{photos}{args.size}px;"
        f" {args.model} (timm's own stem in both), {args.epochs} epochs, batch {args.batch_size},"
        f" lr {args.lr}, seeds {seeds} (folders from data seed {args.data_seed}+i), one CPU"
        f" process, {os.cpu_count()} cores",
        flush=True,
    )
    results = {"timm": [], "ours": []}
    final = {"timm": [], "ours": []}  # the last epoch's accuracy per seed
    with tempfile.TemporaryDirectory(prefix="accel_train_vs_timm_") as tmp:
        for i, seed in enumerate(seeds):
            data = make_folder(
                Path(tmp) / f"shapes{i}",
                args.size,
                args.train_per_class,
                args.val_per_class,
                args.data_seed + i,
                photos=args.photos,
                shape=tuple(map(float, args.shape.split(","))),
                classes=classes,
            )
            for r in range(args.repeats):
                for name in ("timm", "ours") if (r + i) % 2 == 0 else ("ours", "timm"):
                    out = Path(tmp) / f"{name}{i}_{r}"
                    out.mkdir()
                    res = (timm_run if name == "timm" else ours_run)(args, data, out, env, seed)
                    results[name].append(res)
                    if r == 0:
                        final[name].append(res["acc"][-1])
                    print(
                        f"{name} seed {seed} run {r + 1}: wall {res['wall']:.1f}s; epoch ends at "
                        f"{', '.join(f'{t:.1f}' for t in res['epoch_ends'])}s; acc per epoch "
                        f"{', '.join(f'{a:.3f}' for a in res['acc'])}",
                        flush=True,
                    )
                    if res.get("chosen") and i == r == 0:
                        print("   ours chose: " + " | ".join(res["chosen"]), flush=True)
            shutil.rmtree(data)
        imports = {
            m: import_time(m, env)
            for m in ("torch", "timm", "accelerate", "accel_train.training.loop")
        }
    walls = {k: sorted(r["wall"] for r in v) for k, v in results.items()}
    med = {k: v[len(v) // 2] for k, v in walls.items()}
    print(
        "imports (s, each in a fresh process, cumulative): "
        + ", ".join(f"{k} {v:.2f}" for k, v in imports.items())
    )
    print(
        f"wall (s) timm {[round(w, 1) for w in walls['timm']]} ours"
        f" {[round(w, 1) for w in walls['ours']]}; ours/timm = {med['ours'] / med['timm']:.2f}"
    )
    print(summary(final["ours"], final["timm"]))


def summary(ours: list[float], timm: list[float]) -> str:
    """The last epoch's accuracy per seed, the means and the paired difference ours - timm with its
    standard error (over seeds: the spread of the difference itself, folder and training seed both
    varying)."""
    diff = np.array(ours) - np.array(timm)
    se = diff.std(ddof=1) / np.sqrt(len(diff)) if len(diff) > 1 else float("nan")
    return (
        f"final accuracy per seed: ours {', '.join(f'{a:.3f}' for a in ours)}; timm"
        f" {', '.join(f'{a:.3f}' for a in timm)}\nmean: ours {np.mean(ours):.4f}, timm"
        f" {np.mean(timm):.4f}; ours - timm = {diff.mean():+.4f} (standard error {se:.4f},"
        f" {len(diff)} paired seeds)"
    )


if __name__ == "__main__":
    main()
