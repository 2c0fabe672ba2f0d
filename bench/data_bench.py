"""Data only: images per second (and per core) from an image folder on disk to a normalised training
batch on the device, for accel_train's cpu pipeline (0 workers, the default workers, the decoded
cache) and timm's own `create_loader` (its workers and prefetcher, training transforms without
colour jitter: crop, flip, normalise), on the same folder: RandomResizedCrop (scale 0.08-1, ratio
3/4-4/3) and a flip in every case, ours from the whole image stored at 1.5x (crops.py), timm's from
the decoded file. No model runs.

    # write a folder: 2400 + 10% val JPEGs, ~450x350; then read it
    python bench/data_bench.py --make /tmp/photos 2400
    python bench/data_bench.py --data_dir /tmp/photos [--image_size 224 --batch_size 64
        --batches 12 --rounds 3]
    # shorter side >= 900 (4x the training size): the reduced-scale decode vs a full one
    python bench/data_bench.py --make /tmp/big 240 --photo 1300x1000
    python bench/data_bench.py --data_dir /tmp/big --cases full,reduced

Cases (--cases, comma separated): `cpu0` (our cpu pipeline, no workers), `cpu` (its default
workers), `cache` (`--pipeline cache`: the folder decoded once into ~/.cache/accel_train/decoded, or
$XDG_CACHE_HOME; its one-time write is timed apart), `timm` (timm.data.create_loader, the default
worker count), `full` and `reduced` (the cpu pipeline with default workers and JPEGs decoded at full
size, i.e. Pillow's Image.draft made a no-op, or at libjpeg's reduced scale, our default). The cases
alternate round by round on the same cores (`--rounds`); each round times `--batches` batches after
1 + 4 x workers of warm-up (the batches the workers prefetched before the clock starts); the table
gives the median round. Per core: images/s over the cores the case can use, min(CPU affinity, max(1,
workers)). The last lines are the ratios the issue asks for.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from PIL import JpegImagePlugin

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# as the trainer sets it (accel_train/cli.py main), before torch: every case here (timm's too)
# allocates with it
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
DRAFT = JpegImagePlugin.JpegImageFile.draft  # Pillow's own: libjpeg's reduced-scale decode


def make_folder(
    root: Path, n: int, photo: tuple[int, int], classes: int = 10, seed: int = 0
) -> None:
    """n training JPEGs (and n/10 validation ones) that compress like photos: smooth shading,
    texture, grain, each image a little off `photo` in size (+-10%); written by one process per
    core."""
    from multiprocessing import Pool

    jobs = [
        (root / split / f"class_{i % classes}" / f"{i:06d}.jpg", photo, (seed, s, i))
        for s, (split, count) in enumerate((("train", n), ("val", max(classes, n // 10))))
        for i in range(count)
    ]
    for folder in {path.parent for path, _, _ in jobs}:
        folder.mkdir(parents=True, exist_ok=True)
    with Pool(len(os.sched_getaffinity(0))) as pool:
        pool.starmap(write_photo, jobs, chunksize=16)


def write_photo(path: Path, photo: tuple[int, int], seed) -> None:
    from PIL import Image

    rng = np.random.default_rng(seed)
    w, h = (int(s * rng.uniform(0.9, 1.1)) for s in photo)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    a, b, c = rng.uniform(20, 200, 3)
    shading = 128 + 90 * np.sin(x / a + c) * np.cos(y / b) + 40 * np.sin(x / 3.1) * np.sin(y / 2.7)
    pixels = shading[..., None] * rng.uniform(0.4, 1.0, 3) + rng.normal(0, 8, (h, w, 3))
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(path, quality=90)


def ours(args, pipeline: str, workers: int | None, full_decode: bool = False):
    """(batches: an iterator of normalised batches on the device, workers, notes)."""
    from PIL import JpegImagePlugin

    from accel_train.config.train_config import TrainConfig
    from accel_train.data import build_data

    # full: every pixel decoded, as without Image.draft (the loader's workers, forked later, inherit
    # the patch)
    JpegImagePlugin.JpegImageFile.draft = (lambda self, mode, size: None) if full_decode else DRAFT
    # channels_last: the batches' memory format the trainer picks on a CPU (measured faster: its
    # start line)
    cfg = TrainConfig(
        data="imagefolder",
        data_dir=args.data_dir,
        image_size=args.image_size,
        batch_size=args.batch_size,
        pipeline=pipeline,
        num_workers=workers,
        mean="0.5,0.5,0.5",
        std="0.25,0.25,0.25",
        channels_last=args.channels_last,
    )
    start = time.perf_counter()
    data = build_data(cfg, args.device)
    setup = time.perf_counter() - start

    def batches():
        while True:
            data.train_loader.dataset.set_epoch(0)
            for batch in data.train_loader:
                x, _ = data.inputs(
                    tuple(t.to(args.device, non_blocking=True) for t in batch), train=True
                )
                yield x

    return batches(), data.train_loader.num_workers, f"{setup:.1f} s to set up; " + data.describe()


def timm_loader(args, workers: int):
    import torch
    from timm.data import create_dataset, create_loader

    dataset = create_dataset("", root=str(Path(args.data_dir) / "train"), is_training=True)
    loader = create_loader(
        dataset,
        input_size=(3, args.image_size, args.image_size),
        batch_size=args.batch_size,
        is_training=True,
        color_jitter=0.0,
        num_workers=workers,
        device=torch.device(args.device),
        pin_memory=args.device != "cpu",
        use_prefetcher=True,
        persistent_workers=True,
    )

    def batches():
        while True:
            for x, _ in loader:
                yield x

    return (
        batches(),
        workers,
        f"timm {__import__('timm').__version__} create_loader, {workers} workers",
    )


def kernels(args) -> None:
    """--kernels: the crop's resampling alone, one thread, per image, for each kernel tried: a batch
    of the folder's photos, each stored whole at store_size as the cache stores it (H x W x 3),
    RandomResizedCrop boxes from (seed 0, epoch 0, index), resized bilinear to --image_size. Pillow
    crops and resizes the decoded photo itself, as timm's transform does; OpenCV where it is
    installed."""
    import torch
    from PIL import Image

    from accel_train.data.crops import (
        pixel_boxes,
        resized_crop,
        resized_crop_each,
        rrc_boxes,
        store_size,
    )

    torch.set_num_threads(1)
    files = sorted((Path(args.data_dir) / "train").rglob("*.jpg"))[: args.batch_size]
    size, side = args.image_size, store_size(args.image_size)
    photos = [Image.open(f).convert("RGB") for f in files]
    # as the decoded cache holds them: H x W x 3 rows, seen as N x 3 x L x L channels-last
    stores = torch.stack(
        [torch.from_numpy(np.array(p.resize((side, side), Image.BILINEAR))) for p in photos]
    ).permute(0, 3, 1, 2)
    nchw = stores.contiguous()
    n = len(photos)
    boxes = rrc_boxes(torch.arange(n), 0, 0, torch.tensor([p.width / p.height for p in photos]))
    flips = torch.zeros(n, dtype=torch.long)
    out = torch.empty((n, size, size, 3), dtype=torch.uint8).permute(0, 3, 1, 2)
    px = pixel_boxes(boxes, side, side).long().tolist()

    def v2_nchw():
        from torchvision.transforms.v2.functional import resize

        for k, (x0, y0, x1, y1) in enumerate(px):
            out[k].copy_(resize(nchw[k, :, y0:y1, x0:x1], [size, size], antialias=True))

    # timm: RandomResizedCropAndInterpolation -> torchvision's resized_crop on a PIL image
    def pillow():
        for p, (x0, y0, x1, y1) in zip(photos, boxes.tolist()):
            box = (
                round(x0 * p.width),
                round(y0 * p.height),
                round(x1 * p.width),
                round(y1 * p.height),
            )
            p.crop(box).resize((size, size), Image.BILINEAR)

    cases = {
        "roi_align on floats (the device pipeline's kernel, here on the CPU)": lambda: resized_crop(
            stores, boxes, flips, size
        ),
        "torch's uint8 resize, channels-last rows (the cpu and cache pipelines' workers)": (
            lambda: resized_crop_each(stores, boxes, flips, out)
        ),
        "torchvision v2 resize on uint8 N x 3 x L x L rows": v2_nchw,
        "Pillow crop + resize of the decoded photo (timm's transform)": pillow,
    }
    try:
        import cv2

        def opencv():
            hwc = stores.permute(0, 2, 3, 1).numpy()  # (no copy: the rows as stored)
            for k, (x0, y0, x1, y1) in enumerate(px):
                cv2.resize(hwc[k, y0:y1, x0:x1], (size, size), interpolation=cv2.INTER_AREA)

        cases["OpenCV resize (INTER_AREA) on uint8"] = opencv
    except ImportError:
        cases["OpenCV: not installed (not a dependency)"] = None
    print(
        f"# resample alone: {n} photos of {args.data_dir}, stored at {side} px, bilinear to {size}"
        f" px, one thread, median of {args.rounds} rounds"
    )
    for name, fn in cases.items():
        if fn is None:
            print(f"{'-':>8s}  {name}")
            continue
        fn()  # (warm)
        times = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) / n * 1e3)
        print(f"{statistics.median(times):6.2f} ms/img  {name}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--make", nargs=2, metavar=("DIR", "N"), help="write a folder of N training JPEGs and exit"
    )
    p.add_argument("--photo", default="450x350", help="--make: the photos' size WxH")
    p.add_argument("--data_dir")
    p.add_argument("--image_size", type=int, default=224)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--batches", type=int, default=12, help="timed batches per case and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default=None, help="default: cuda where there is one, else cpu")
    p.add_argument("--cases", default="cpu0,cpu,cache,timm")
    p.add_argument(
        "--channels_last",
        type=lambda v: v == "true",
        default=True,
        help="true/false: our batches' memory format (timm's loader gives NCHW)",
    )
    p.add_argument(
        "--kernels",
        action="store_true",
        help="time the crop's resampling alone per kernel and exit",
    )
    args = p.parse_args(argv)
    if args.make:
        make_folder(
            Path(args.make[0]), int(args.make[1]), tuple(int(v) for v in args.photo.split("x"))
        )
        return 0
    if args.kernels:
        kernels(args)
        return 0
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device == "cpu":
        # this process is the device: it normalises (every case: timm's prefetcher, our inputs)
        # with one thread; two oversubscribe the cores the workers use (0.67 vs 0.24 ms/img)
        torch.set_num_threads(1)
    from accel_train.platform.cores import worker_count

    default_workers = worker_count(None)[0]
    cores = len(os.sched_getaffinity(0))
    makers = {
        "cpu0": lambda: ours(args, "cpu", 0),
        "cpu": lambda: ours(args, "cpu", None),
        "cache": lambda: ours(args, "cache", None),
        "timm": lambda: timm_loader(args, default_workers),
        "reduced": lambda: ours(args, "cpu", None),
        "full": lambda: ours(args, "cpu", None, full_decode=True),
    }
    cases = args.cases.split(",")
    rates: dict[str, list[float]] = {c: [] for c in cases}
    print(
        f"# {args.data_dir}: {args.image_size} px, batch {args.batch_size}, device {args.device},"
        f" {cores} cores in the CPU affinity ({os.cpu_count()} online), torch {torch.__version__}",
        flush=True,
    )
    for r in range(args.rounds):
        for case in cases:
            # a fresh loader per round: the cases share the cores fairly
            batches, workers, notes = makers[case]()
            if r == 0:
                print(f"# {case}: {notes}", flush=True)
            for _ in range(1 + 4 * workers):
                # warm-up: the workers start; the batches they prefetched meanwhile
                # (up to 4 each) are taken, so that the timed ones are made while timed
                next(batches)
            start = time.perf_counter()
            for _ in range(args.batches):
                x = next(batches)
            if x.device.type == "cuda":
                torch.cuda.synchronize()
            rates[case].append(args.batches * args.batch_size / (time.perf_counter() - start))
            del batches, x
            gc.collect()  # the loader's persistent workers end with it
    print(f"{'case':8s} {'workers':>7s} {'img/s':>8s} {'per core':>9s} {'min':>8s} {'max':>8s}")
    per_core = {}
    for case in cases:
        workers = 0 if case == "cpu0" else default_workers
        used = min(cores, max(1, workers))
        median = statistics.median(rates[case])
        per_core[case] = median / used
        print(
            f"{case:8s} {workers:7d} {median:8.0f} {per_core[case]:9.0f} {min(rates[case]):8.0f} "
            f"{max(rates[case]):8.0f}"
        )
    for a, b in (("cache", "timm"), ("cpu", "timm"), ("cpu", "cpu0"), ("reduced", "full")):
        if a in per_core and b in per_core:
            print(f"{a}/{b} per core = {per_core[a] / per_core[b]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
