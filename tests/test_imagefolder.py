"""Training on your own images: an image folder (PNG and JPEG, grayscale, palette and RGB, mixed
sizes, class names that are not numbers), both pipelines, the data set's facts in model_config.json,
evaluate, predict, --init_from, exact resume, and every bad input of the layout."""

import json
import os
import re
import shutil

import numpy as np
import pytest
import torch
from conftest import clean_env, launch, run_cli, write_cifar
from PIL import Image
from safetensors.torch import load_file, save_file

from accel_train.config.train_config import TrainConfig
from accel_train.data import (
    CIFAR10,
    DataInfo,
    build_data,
    crop_flip,
    crop_flip_params,
    decode_image,
)
from accel_train.errors import ConfigError

# class name -> brightness: learnable from RGB and from grayscale, survives resizing, JPEG, crops
# and flips
CLASSES = {"apple": 40, "banana_split": 128, "cherry-2": 215}
KINDS = [("RGB", "png"), ("L", "jpg"), ("RGB", "jpg"), ("L", "png"), ("P", "png"), ("RGBA", "png")]
SMALL = [
    "--data",
    "imagefolder",
    "--image_size",
    "16",
    "--batch_size",
    "8",
    "--lr",
    "0.05",
    "--warmup_epochs",
    "0",
]


def write_image_folder(root, train=8, val=4, classes=CLASSES, eval_dir="val", seed=0):
    rng = np.random.default_rng(seed)
    for split, n in (("train", train), (eval_dir, val)):
        for name, level in classes.items():
            d = root / split / name
            d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                mode, ext = KINDS[i % len(KINDS)]
                w, h = int(rng.integers(20, 49)), int(rng.integers(20, 49))
                img = Image.fromarray(
                    np.clip(level + rng.integers(-30, 31, (h, w, 3)), 0, 255).astype(np.uint8)
                )
                (img.convert("P") if mode == "P" else img.convert(mode)).save(
                    d / f"img_{i:03d}.{ext}"
                )
    return root


def rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------------------------------------
# In process: reader, description, augmentation, pipelines
# ---------------------------------------------------------------------------------------------


def test_folder_is_read_sorted_converted_resized_and_described(tmp_path):
    root = write_image_folder(tmp_path / "d", eval_dir="validation")
    (root / "train" / "apple" / "notes.txt").write_text(
        "not an image, not an image extension: skipped"
    )
    data = build_data(
        TrainConfig(data="imagefolder", data_dir=str(root), image_size=24, batch_size=4), "cpu"
    )
    info = data.info
    assert info.classes == ("apple", "banana_split", "cherry-2") and info.num_classes == 3
    assert (
        info.image_size == 24 and info.pad == 3 and data.train_size == 24 and data.test_size == 12
    )
    assert data.pipeline == "device" and re.search(
        r"train: 24 images decoded once at \d+ images/s", data.describe()
    )
    # mean/std computed from the training images (the classes' grey levels, not CIFAR-10's numbers)
    expected = np.mean([40, 128, 215]) / 255
    assert all(abs(m - expected) < 0.03 for m in info.mean) and all(0.2 < s < 0.4 for s in info.std)
    x, y = data.inputs(torch.arange(12), train=False)
    assert x.shape == (12, 3, 24, 24) and y.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    # every mode (L, P, RGBA, JPEG) became RGB with the class's level, whatever the source size
    raw = x * torch.tensor(info.std).view(1, 3, 1, 1) + torch.tensor(info.mean).view(1, 3, 1, 1)
    levels = (raw.mean((1, 2, 3)) * 255).tolist()
    for level, label in zip(levels, y.tolist()):
        assert abs(level - list(CLASSES.values())[label]) < 12


def test_decode_keeps_aspect_by_centre_crop(tmp_path):
    img = np.zeros((20, 60, 3), np.uint8)
    img[:, 20:40] = 255  # a white centre third of a wide image
    Image.fromarray(img).save(tmp_path / "wide.png")
    x = decode_image(tmp_path / "wide.png", 10)
    assert x.shape == (3, 10, 10) and x.dtype == torch.uint8 and x.float().mean() > 240


def test_16_bit_grayscale_keeps_its_range(tmp_path):
    # 16-bit grayscale (medical imaging, microscopy): Pillow's convert("RGB") clips at 255 (99%
    # white for this gradient); decoding keeps the top 8 bits of 16. A 16-bit PNG opens as I;16, a
    # 32-bit int TIFF as I.
    # columns 0..65535
    gradient = np.tile(np.linspace(0, 65535, 64).round().astype(np.uint16), (64, 1))
    Image.fromarray(gradient).save(tmp_path / "g16.png")
    Image.fromarray(gradient.astype(np.int32)).save(tmp_path / "g32.tif")
    expected = torch.from_numpy((gradient >> 8).astype(np.uint8))
    for name, mode in (("g16.png", "I;16"), ("g32.tif", "I")):
        with Image.open(tmp_path / name) as img:
            assert img.mode == mode
        x = decode_image(tmp_path / name, 64)  # its own size: no resize
        assert x.shape == (3, 64, 64) and x.dtype == torch.uint8
        assert torch.equal(x[0], x[1]) and torch.equal(x[0], x[2]), name
        assert torch.equal(x[0], expected), (name, x[0, 0, ::8].tolist())


def test_exif_orientation_is_applied(tmp_path):
    # a phone photo: stored landscape with EXIF orientation 6 (turn 90 degrees clockwise to view),
    # shown upright
    stored = np.zeros((40, 80, 3), np.uint8)
    stored[:, :40] = 255  # the stored left half: the top half once turned
    img = Image.fromarray(stored)
    exif = img.getexif()
    exif[0x0112] = 6
    img.save(tmp_path / "phone.jpg", exif=exif, quality=95)
    # 20 x 40 upright, centre crop: rows 10..30
    x = decode_image(tmp_path / "phone.jpg", 20).float()
    # top white, bottom black
    assert x[:, :8].mean() > 230 and x[:, 12:].mean() < 25, x[0, :, 10].tolist()
    assert abs(x[:, :, :10].mean() - x[:, :, 10:].mean()) < 10  # left and right alike


def test_a_large_jpeg_is_decoded_at_reduced_scale_close_to_a_full_decode(tmp_path, monkeypatch):
    # A 1600 x 1200 photo-like JPEG (smooth shading, a fine texture of ~4 px at the training size, a
    # gradient per channel, grain) at training size 224: libjpeg decodes it at 1/4 scale (400 x 300,
    # the smallest still >= 224 on both sides; 1/8 would be 200 x 150) through Image.draft, then the
    # usual resize and centre crop. Against a full-size decode resized the same way, measured here:
    # mean |difference| 0.59 levels, at most 4 (a decode at 1/8, below the training size: 2.57 and
    # 24); asserted: mean < 1.2, max <= 10 (of 255).
    from PIL import JpegImagePlugin

    from accel_train.data.images import to_rgb

    y, x = np.mgrid[0:1200, 0:1600].astype(np.float32)
    shading = 128 + 100 * np.sin(x / 97) * np.cos(y / 131) + 50 * np.sin(x / 4.5) * np.sin(y / 4.5)
    pixels = np.stack([shading, 255 * x / 1600, 255 * y / 1200], -1)
    pixels += np.random.default_rng(0).normal(0, 6, pixels.shape)
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(tmp_path / "big.jpg", quality=90)
    drafted = []
    draft = JpegImagePlugin.JpegImageFile.draft

    def spy(self, mode, size):
        result = draft(self, mode, size)
        drafted.append((size, self.size))  # (the size asked, the size libjpeg will decode at)
        return result

    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", spy)
    size = 224
    reduced = decode_image(tmp_path / "big.jpg", size)
    # the reduced-scale path, at the right scale
    assert drafted == [((size, size), (400, 300))], drafted
    assert reduced.shape == (3, size, size) and reduced.dtype == torch.uint8
    with Image.open(tmp_path / "big.jpg") as img:
        # the full decode: every pixel, then the same resize and crop
        img = to_rgb(img)
        assert img.size == (1600, 1200)
        img = img.resize((round(1600 * size / 1200), size), Image.BILINEAR)
        left = (img.size[0] - size) // 2
        full = torch.from_numpy(np.asarray(img.crop((left, 0, left + size, size))).copy()).permute(
            2, 0, 1
        )
    diff = (reduced.float() - full.float()).abs()
    assert diff.mean() < 1.2 and diff.max() <= 10, (diff.mean().item(), diff.max().item())


def test_mean_std_flags_override_the_computed_ones(tmp_path):
    root = write_image_folder(tmp_path / "d")
    cfg = TrainConfig(
        data="imagefolder", data_dir=str(root), image_size=16, mean="0.1,0.2,0.3", std="0.5,0.5,0.5"
    )
    info = build_data(cfg, "cpu").info
    assert info.mean == (0.1, 0.2, 0.3) and info.std == (0.5, 0.5, 0.5)
    with pytest.raises(ConfigError, match="--std must be three numbers"):
        TrainConfig(std="0,1")
    with pytest.raises(ConfigError, match="CIFAR-10 images are 32x32"):
        TrainConfig(data="cifar10", image_size=64)


def test_crop_padding_scales_with_size_and_hflip_false_never_mirrors():
    assert CIFAR10.pad == 4 and DataInfo("x", ("a",), (0.5,) * 3, (0.5,) * 3, 64).pad == 8
    images = torch.randint(0, 256, (32, 3, 64, 64), dtype=torch.uint8)
    top, left, flip = crop_flip_params(torch.arange(32), epoch=1, seed=3, pad=8, hflip=False)
    assert flip.sum() == 0 and top.max() <= 16 and left.max() <= 16 and top.max() > 8
    out = crop_flip(images, top, left, flip, pad=8)
    padded = torch.nn.functional.pad(images, (8, 8, 8, 8))
    for i in range(32):
        assert torch.equal(out[i], padded[i, :, top[i] : top[i] + 64, left[i] : left[i] + 64])
    # flips by default
    assert crop_flip_params(torch.arange(64), epoch=1, seed=3, pad=8)[2].sum() > 0
    # the cpu pipeline's workers augment with the same hash (and the same --hflip) as the device
    # pipeline
    kw = dict(hflip=False, batch_size=4, train_samples=16, test_samples=4)
    cpu = build_data(TrainConfig(pipeline="cpu", **kw), "cpu")
    device = build_data(TrainConfig(pipeline="device", **kw), "cpu")
    cpu.train_loader.dataset.set_epoch(3)
    for i in range(16):
        x = cpu.inputs(cpu.train_loader.dataset.__getitems__([i]), train=True, epoch=3)[0]
        assert torch.allclose(
            x, device.inputs(torch.tensor([i]), train=True, epoch=3)[0], atol=1e-5
        )


def test_pipeline_choice_says_why_and_cpu_decodes_the_same_images(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
    root = write_image_folder(tmp_path / "d")
    kw = dict(
        data="imagefolder",
        data_dir=str(root),
        image_size=16,
        batch_size=4,
        mean="0.5,0.5,0.5",
        std="0.25,0.25,0.25",
    )
    # auto: the local disk has room
    cached = build_data(TrainConfig(device_data_mb=0.001, **kw), "cpu")
    assert (
        cached.pipeline == "cache"
        and "do not fit the 0 MiB allowed on cpu (--device_data_mb), the local disk has room"
        in cached.describe()
        and len(list((tmp_path / "home/accel_train/decoded").glob("*.npy"))) == 2
    )
    small = build_data(TrainConfig(pipeline="cpu", **kw), "cpu")
    # decoded per sample
    assert small.pipeline == "cpu" and small.test_loader.dataset.split.cache is None
    with pytest.raises(ConfigError, match="use --pipeline cpu"):
        build_data(TrainConfig(pipeline="device", device_data_mb=0.001, **kw), "cpu")
    device = build_data(TrainConfig(**kw), "cpu")
    assert device.pipeline == "device" and "fit the" in device.describe()
    xd, yd = device.inputs(next(iter(device.test_loader)), train=False)
    for data in (small, cached):
        xc, yc = data.inputs(next(iter(data.test_loader)), train=False)
        # (1e-5: well below a level, 0.016)
        assert torch.allclose(xd, xc, atol=1e-5) and torch.equal(yd, yc)


def test_decoded_cache_is_reused_and_rewritten_when_the_folder_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
    root = write_image_folder(tmp_path / "d", train=4, val=2)
    kw = dict(
        data="imagefolder",
        data_dir=str(root),
        image_size=16,
        batch_size=4,
        pipeline="cache",
        num_workers=0,
    )
    first = build_data(TrainConfig(**kw), "cpu")
    assert re.search(
        r"train: decoded cache \S+ \(0 MiB\) written once for this machine", first.describe()
    )
    path = first.train_loader.dataset.split.cache
    np.load(path, mmap_mode="r+")[0] = (
        7  # marks the cached image 0: a read of the file, not a decode, returns it
    )
    again = build_data(TrainConfig(**kw), "cpu")
    assert "written by an earlier run: read, not decoded" in again.describe()
    assert (
        again.train_loader.dataset.split.cache == path
        and (again.test_loader.dataset.images([0]) != 7).all()
    )
    assert (again.train_loader.dataset.images([0]) == 7).all()
    # a changed file (same name and size, new contents and mtime) makes a new cache; the stale one
    # is removed
    first_file = sorted((root / "train" / "apple").iterdir())[0]
    Image.open(first_file).point(lambda v: 255 - v).save(first_file)
    changed = build_data(TrainConfig(**kw), "cpu")
    assert changed.train_loader.dataset.split.cache != path and not path.exists()
    assert torch.equal(
        # (the split's decode: the whole image, crops.py)
        changed.train_loader.dataset.images([0])[0],
        decode_image(first_file, changed.train_loader.dataset.split.decode),
    )
    # a file removed: a new cache too, of one image less; a writer of this machine killed mid-write
    # left its temporary file (pid 2**22 + 1: above Linux's pid_max, never running): removed; a
    # running writer's stays
    first_file.unlink()
    host = __import__("socket").gethostname()
    abandoned = path.with_name(f".{path.name.rsplit('-', 1)[0]}-0123.npy.{host}.{2**22 + 1}.tmp")
    # (pid 1 runs: no lock needed)
    running = path.with_name(f".{path.name.rsplit('-', 1)[0]}-4567.npy.{host}.1.tmp")
    abandoned.write_bytes(b"x" * 1000)
    running.write_bytes(b"x")
    fewer = build_data(TrainConfig(**kw), "cpu")
    assert (
        fewer.train_size == 11
        and np.load(fewer.train_loader.dataset.split.cache, mmap_mode="r").shape[0] == 11
    )
    assert not abandoned.exists() and running.exists()
    running.unlink()
    # train + val, no temp
    assert len(list(path.parent.glob("*.npy"))) == 2 and not list(path.parent.glob(".*"))


def test_a_cache_writer_removes_only_its_own_machines_abandoned_files(tmp_path, monkeypatch):
    # ~/.cache on a home shared by several machines: "gpu1" must not take "gpu1.cluster"'s or
    # "login.gpu1"'s file of a writer running there for its own (their pids do not run here);
    # before, its glob matched them and removed them
    from accel_train.data.cache import remove_abandoned

    monkeypatch.setattr("socket.gethostname", lambda: "gpu1")
    path = tmp_path / "imgs-0123abcd-16px-0123456789abcdef0123.npy"
    name = f".{path.name.rsplit('-', 1)[0]}-ffffffffffffffffffff.npy"
    dead = 2**22 + 1  # above Linux's pid_max: never running
    others = [
        tmp_path / f"{name}.{host}.{dead}.tmp" for host in ("gpu1.cluster", "login.gpu1", "gpu1.7")
    ]
    mine = tmp_path / f"{name}.gpu1.{dead}.tmp"
    for f in (
        *others,
        mine,
        tmp_path / f"{name}.gpu1.{2**70}.tmp",
    ):
        # (and a pid no machine has: no crash)
        f.write_bytes(b"x")
    remove_abandoned(path)
    assert all(f.exists() for f in others) and not mine.exists()


def test_a_cache_written_meanwhile_by_another_machine_is_kept_not_replaced(tmp_path, monkeypatch):
    # a home shared by several machines (NFS): both decode the same folder; the one that finishes
    # second keeps the first one's file (its ranks may have it mapped), removes its own temporary
    # file, and reads the same images
    from accel_train.data import cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
    root = write_image_folder(tmp_path / "d", train=4, val=2)
    files = sorted((root / "train").rglob("*.png"))
    path = cache.cache_path(files, 16)
    decode = cache.decode_all

    others = []

    def other_machine_finishes_first(chunk, size, **kw):
        images, rate = decode(chunk, size)
        if not path.exists():
            np.save(path, images.permute(0, 2, 3, 1).numpy())  # (a cache's rows: H x W x 3)
            others.append(path.stat().st_ino)
        return images, rate

    monkeypatch.setattr(cache, "decode_all", other_machine_finishes_first)
    note = cache.write_cache(files, 16, path)
    assert "written once" in note and not list(path.parent.glob(".*"))
    assert path.stat().st_ino == others[0]  # (os.replace put this machine's file there)
    assert cache.write_cache(files, 16, path).endswith(
        "written by an earlier run: read, not decoded"
    )
    # a damaged file under the name (not a complete cache of this shape) is replaced
    path.write_bytes(b"damaged")
    monkeypatch.setattr(cache, "decode_all", decode)
    cache.write_cache(files, 16, path)
    assert cache.open_cache(path, len(files), 16) is not None
    # a cache of N x 3 x H x W rows (written before the rows were H x W x 3) is written again, as
    # decoded
    images = decode(files, 16)[0]
    np.save(path, images.numpy())
    assert cache.open_cache(path, len(files), 16) is None
    assert "written once" in cache.write_cache(files, 16, path)
    assert np.array_equal(
        cache.open_cache(path, len(files), 16), images.permute(0, 2, 3, 1).numpy()
    )
    assert torch.equal(cache.as_images(cache.open_cache(path, len(files), 16)[:]), images)
    # a file system without hard links (link(2): EPERM on FAT/exFAT, ENOTSUP/EOPNOTSUPP on some FUSE
    # mounts): renamed
    path.unlink()

    def no_links(src, dst):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(cache.os, "link", no_links)
    assert "written once" in cache.write_cache(files, 16, path) and not list(path.parent.glob(".*"))
    assert cache.open_cache(path, len(files), 16) is not None


def test_auto_takes_the_cache_only_on_a_local_disk(tmp_path, monkeypatch):
    # a home on NFS (a cluster's shared home): every epoch would read the cache over the network,
    # and machines with their own copies of the folder would remove each other's caches; auto
    # decodes per sample and says why
    from accel_train.data import cache

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    mounts = tmp_path / "mounts"
    table = f"overlay / overlay rw 0 0\nserver:/export {tmp_path} nfs4 rw 0 0\n"
    mounts.write_text(table)
    assert (
        cache.file_system(home, str(mounts)) == "nfs4"
        and cache.file_system("/usr", str(mounts)) == "overlay"
    )
    assert "is nfs4, not local: set XDG_CACHE_HOME to a local disk" in cache.no_room(1, str(mounts))
    mounts.write_text(table.replace("nfs4", "ext4"))
    assert cache.no_room(1, str(mounts)) is None and "GiB free" in cache.no_room(2**60, str(mounts))
    monkeypatch.setattr(cache, "file_system", lambda path, mounts="": "nfs")
    root = write_image_folder(tmp_path / "d", train=4, val=2)
    auto = build_data(
        TrainConfig(
            data="imagefolder",
            data_dir=str(root),
            image_size=16,
            batch_size=4,
            num_workers=0,
            device_data_mb=0.001,
        ),
        "cpu",
    )
    assert auto.pipeline == "cpu" and "is nfs, not local: set XDG_CACHE_HOME" in auto.describe()
    assert not list(home.rglob("*.*"))


def test_a_full_or_read_only_disk_decodes_per_sample_with_one_line(tmp_path, monkeypatch):
    import os
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    root = write_image_folder(tmp_path / "d", train=40, val=2)
    # (the training split at 64 px: the sizes below)
    kw = dict(
        data="imagefolder",
        data_dir=str(root),
        image_size=64,
        batch_size=4,
        num_workers=0,
        train_crop="pad",
    )
    full, ro = tmp_path / "full", tmp_path / "ro"
    for mnt, opts in (
        (full, "size=64k"),
        (ro, "size=64k,ro"),
    ):
        # the training split is 120 x 12 KiB decoded
        mnt.mkdir()
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(mnt)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if proc.returncode != 0:
            pytest.skip(f"mount refused here: {proc.stderr.strip()}")
    try:
        device = build_data(TrainConfig(**kw), "cpu")
        for mnt, reason in ((full, "No space left on device"), (ro, "Read-only file system")):
            monkeypatch.setenv("XDG_CACHE_HOME", str(mnt))
            data = build_data(TrainConfig(pipeline="cache", **kw), "cpu")
            line = re.search(
                r"train: the decoded cache cannot be written \(([^)]*)\): decoding per sample",
                data.describe(),
            )
            assert line and reason in line.group(1), data.describe()
            # nothing partial
            assert data.train_loader.dataset.split.cache is None and not list(mnt.rglob("*.*"))
            x, y = data.inputs(data.train_loader.dataset.__getitems__([0, 5]), train=False)
            assert torch.allclose(
                x, device.inputs(torch.tensor([0, 5]), train=True, epoch=0)[0], atol=1e-5
            )
        # auto: no room -> decode per sample
        auto = build_data(TrainConfig(device_data_mb=0.001, **kw), "cpu")
        assert auto.pipeline == "cpu" and "nor the local disk" in auto.describe()
    finally:
        for mnt in (full, ro):
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def test_evaluation_reads_only_the_evaluation_split(tmp_path):
    root = write_image_folder(tmp_path / "d")
    info = build_data(
        TrainConfig(data="imagefolder", data_dir=str(root), image_size=16), "cpu"
    ).info
    for f in (root / "train").rglob("*.*"):
        f.write_bytes(b"broken")  # training images unreadable: evaluation must not open them
    data = build_data(
        TrainConfig(data="imagefolder", data_dir=str(root), image_size=16),
        "cpu",
        info=info,
        eval_only=True,
    )
    assert data.train_loader is None and data.test_size == 12 and data.info == info
    write_cifar(tmp_path / "c")
    (tmp_path / "c" / "cifar-10-batches-py" / "data_batch_3").unlink()
    data = build_data(
        TrainConfig(data="cifar10", data_dir=str(tmp_path / "c")),
        "cpu",
        info=CIFAR10,
        eval_only=True,
    )
    assert data.test_size == 11


# ---------------------------------------------------------------------------------------------
# Bad input: one line naming the fix (and the file), exit 2, nothing written
# ---------------------------------------------------------------------------------------------


def break_folder(case, root, tmp_path):
    write_image_folder(root)
    if case == "no_train":
        (root / "train").rename(root / "training")
    elif case == "no_eval":
        (root / "val").rename(root / "holdout")
    elif case == "eval_class_unknown":
        (root / "val" / "durian").mkdir()
        (root / "val" / "apple" / "img_000.png").rename(root / "val" / "durian" / "img_000.png")
    elif case == "empty_class":
        (root / "train" / "zucchini").mkdir()
    elif case in ("not_an_image", "not_an_image_cpu"):
        (root / "train" / "banana_split" / "img_003.png").write_bytes(b"\x89PNG but then nothing")
    elif case == "truncated_cache":
        # its header reads; its pixels end early: named when the cache is written
        jpeg = root / "train" / "cherry-2" / "img_001.jpg"
        jpeg.write_bytes(jpeg.read_bytes()[:300])
        return ["--pipeline", "cache"]
    elif case == "too_few":
        return ["--batch_size", "32"]
    elif case == "init_not_safetensors":
        (tmp_path / "w.safetensors").write_bytes(b"{not safetensors at all")
        return ["--init_from", tmp_path / "w.safetensors"]
    elif case == "init_does_not_fit":
        # an imagenet-stem resnet18's weights into the cifar stem, asked for (auto
        import timm  # takes the weights' stem: test_model)

        save_file(
            timm.create_model("resnet18", num_classes=3).state_dict(), tmp_path / "w.safetensors"
        )
        return ["--init_from", tmp_path / "w.safetensors", "--stem", "cifar"]
    elif case == "init_foreign":
        save_file({"encoder.weight": torch.zeros(2, 2)}, tmp_path / "w.safetensors")
        return ["--init_from", tmp_path / "w.safetensors"]
    return ["--pipeline", "cpu"] if case == "not_an_image_cpu" else []


BAD = {
    "no_train": "has no train/ folder",
    "no_eval": "has no evaluation split; add",
    "eval_class_unknown": "class folder(s) durian are not in the training split",
    "empty_class": "zucchini has no images",
    "not_an_image": "banana_split/img_003.png is not a readable image",
    "not_an_image_cpu": "banana_split/img_003.png is not a readable image",
    "truncated_cache": "cherry-2/img_001.jpg is not a readable image (",
    "too_few": "24 training samples cannot fill one batch of 32",
    "init_not_safetensors": "is not a safetensors file",
    "init_does_not_fit": "does not fit this model (shape mismatch conv1.weight",
    "init_foreign": "does not fit this model (tensors the model lacks: encoder.weight",
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_image_folder(case, tmp_path, monkeypatch):
    if case == "truncated_cache":
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
    root = tmp_path / "d"
    extra = break_folder(case, root, tmp_path)
    out = tmp_path / "out"
    proc = run_cli([*SMALL, "--data_dir", root, "--epochs", "1", "--output_dir", out, *extra])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert (
        len(errors) == 1 and errors[0].startswith("accel-train: error: ") and BAD[case] in errors[0]
    ), proc.stderr
    assert not out.exists() or not any(out.iterdir()), sorted(out.rglob("*"))
    assert not list((tmp_path / "home").rglob("*.npy*")) and not list(
        (tmp_path / "home").rglob(".*")
    )


# ---------------------------------------------------------------------------------------------
# Real runs through accelerate launch
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("folder")
    data = write_image_folder(root / "d", train=8, val=4)
    out = root / "out"
    # inferred from train/
    no_kind = [a for a in SMALL if a not in ("--data", "imagefolder")]
    assert len(no_kind) == len(SMALL) - 2
    proc = launch("cpu.yaml", [*no_kind, "--data_dir", data, "--epochs", "3", "--output_dir", out])
    return data, out, proc.stderr


@pytest.mark.launches
def test_one_rank_learns_and_exports_the_data_sets_facts(trained):
    data, out, log = trained
    assert re.search(
        r"pipeline device: .* fit the .*; train: 24 images decoded once at \d+ images/s", log
    )
    assert rows(out)[-1]["test_acc"] >= 0.9, rows(out)
    meta = json.loads((out / "model_config.json").read_text())
    assert (
        meta["classes"] == list(CLASSES)
        and meta["num_classes"] == 3
        and meta["input_size"] == [3, 16, 16]
    )
    assert (
        meta["data"] == "imagefolder"
        and meta["mean"] != list(CIFAR10.mean)
        and len(meta["std"]) == 3
    )
    # --data was not given: what the folder holds
    assert "data: imagefolder" in (out / "config.yaml").read_text()
    assert load_file(out / "model.safetensors")["fc.weight"].shape == (3, 512)


@pytest.mark.launches
def test_evaluate_equals_the_last_epoch_and_predict_names_the_classes(trained, tmp_path):
    data, out, _ = trained
    # evaluate reads the evaluation split only
    shutil.copytree(data / "val", tmp_path / "only_val" / "val")
    proc = run_cli(
        ["evaluate", "--checkpoint", out, "--data_dir", tmp_path / "only_val", "--batch_size", "5"]
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    acc = float(re.search(r"test accuracy ([\d.]+)% on 12 samples", proc.stdout).group(1))
    assert acc == pytest.approx(100 * rows(out)[-1]["test_acc"], abs=0.01)
    assert [line.split()[0] for line in proc.stdout.splitlines()[2:]] == list(CLASSES)
    images = [data / "val" / name / "img_001.jpg" for name in CLASSES]
    proc = run_cli(["predict", "--checkpoint", out, "--top", "2", *images])
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    for path, line, name in zip(images, lines, CLASSES):
        top = re.findall(r"([\w-]+) ([\d.]+)%", line.split(": ", 1)[1])
        assert (
            line.startswith(f"{path}: ") and len(top) == 2 and {n for n, _ in top} <= set(CLASSES)
        )
        assert top[0][0] == name, line


@pytest.mark.launches
def test_two_ranks_learn_from_one_decoded_cache(tmp_path):
    # the two ranks of one machine share one decoded cache per split: written by the local main
    # process only, mapped by the other rank (its workers: the default, one each on 2 cores) without
    # decoding
    data = write_image_folder(tmp_path / "d", train=8, val=5)
    out, home = tmp_path / "out", tmp_path / "home"
    # --data_url=D: how ModelArts passes the OBS input folder
    proc = launch(
        "2proc_cpu.yaml",
        # (the training images stored at 16 px: the shapes below)
        [
            *SMALL,
            f"--data_url={data}",
            "--batch_size",
            "4",
            "--epochs",
            "3",
            "--pipeline",
            "cache",
            "--log_all_ranks",
            "--output_dir",
            out,
            "--train_crop",
            "pad",
        ],
        env=clean_env(XDG_CACHE_HOME=str(home)),
    )
    r = rows(out)
    assert r[-1]["test_samples"] == 15 and r[-1]["step"] == 9 and r[-1]["test_acc"] >= 0.8, r
    # (and the training cache's .stats.json)
    caches = sorted((home / "accel_train" / "decoded").glob("*.npy"))
    assert sorted(np.load(c, mmap_mode="r").shape for c in caches) == [
        (15, 16, 16, 3),
        (24, 16, 16, 3),
    ], caches
    for split in ("train", "val"):
        assert (
            len(
                re.findall(
                    rf"{split if split == 'train' else 'test'}: decoded cache \S+ \(0 MiB\) written"
                    r" once "
                    "for this machine",
                    proc.stderr,
                )
            )
            == 1
        ), proc.stderr[-3000:]
        assert (
            len(
                re.findall(
                    rf"{split if split == 'train' else 'test'}: the decoded cache \S+, written by"
                    r" this "
                    "machine's local main process",
                    proc.stderr,
                )
            )
            == 1
        ), proc.stderr[-3000:]
    assert re.search(
        r"\d+ workers? per process: \d+ cores in this process's CPU affinity / 2 processes on this "
        "machine",
        proc.stderr,
    ), proc.stderr[-3000:]
    assert "cannot be read here" not in proc.stderr and "decoding per sample" not in proc.stderr
    # evaluate on 2 ranks, no cache yet on this "machine": written during the evaluation by the
    # local main process, mapped by the other rank, the whole split evaluated (the other rank's
    # workers open it only at the first batch, after DDP's start-up broadcast: no race
    # to reproduce before evaluate's on_every_rank)
    home = tmp_path / "home2"
    proc = launch(
        "2proc_cpu.yaml",
        [
            "evaluate",
            "--checkpoint",
            out,
            f"--data_dir={data}",
            "--batch_size",
            "4",
            "--pipeline",
            "cache",
        ],
        env=clean_env(XDG_CACHE_HOME=str(home)),
    )
    assert f"test accuracy {r[-1]['test_acc']:.2%} on 15 samples (2 process(es))" in proc.stdout, (
        proc.stdout
    )
    assert "cannot be read here" not in proc.stderr and "decoding per sample" not in proc.stderr, (
        proc.stderr[-3000:]
    )
    assert [c.name.split("-")[0] for c in (home / "accel_train" / "decoded").iterdir()] == ["val"]


@pytest.mark.launches
def test_init_from_same_classes_loads_everything(trained, tmp_path):
    data, first, _ = trained
    out = tmp_path / "out"
    proc = launch(
        "cpu.yaml",
        [
            *SMALL,
            "--data_dir",
            data,
            "--epochs",
            "1",
            "--max_steps",
            "1",
            "--lr",
            "1e-6",
            "--init_from",
            first / "model.safetensors",
            "--output_dir",
            out,
        ],
    )
    assert "model.safetensors: loaded 122 tensors; none missing" in proc.stderr
    assert rows(out)[-1]["test_acc"] >= 0.9  # starts where the first run ended, not from scratch
    before, after = load_file(first / "model.safetensors"), load_file(out / "model.safetensors")
    assert torch.allclose(
        before["layer1.0.conv1.weight"], after["layer1.0.conv1.weight"], atol=1e-4
    )


@pytest.mark.launches
def test_init_from_other_class_count_recreates_the_head_on_the_cpu_pipeline(trained, tmp_path):
    _, first, _ = trained
    data = write_image_folder(tmp_path / "d", train=8, val=4, classes={"dark": 40, "light": 215})
    out = tmp_path / "out"
    proc = launch(
        "cpu.yaml",
        [
            *SMALL,
            "--data_dir",
            data,
            "--epochs",
            "1",
            "--init_from",
            first / "model.safetensors",
            "--device_data_mb",
            "0.001",
            "--num_workers",
            "1",
            "--output_dir",
            out,
        ],
        env=clean_env(XDG_CACHE_HOME=str(tmp_path / "home")),
    )
    # (auto: the cpu pipeline reading the folder decoded once into the cache)
    assert re.search(
        r"pipeline cache: .* do not fit the 0 MiB allowed .*, the local disk has room", proc.stderr
    )
    assert (
        "loaded 120 tensors; re-initialised fc.weight, fc.bias (3 classes in the file, 2 here)"
        in proc.stderr
    )
    before, after = load_file(first / "model.safetensors"), load_file(out / "model.safetensors")
    assert after["fc.weight"].shape == (2, 512) and json.loads(
        (out / "model_config.json").read_text()
    )["classes"] == ["dark", "light"]
    assert rows(out)[-1]["test_samples"] == 8
    # fine-tuned, not re-drawn
    assert (before["conv1.weight"] - after["conv1.weight"]).abs().max() < 0.05


@pytest.mark.launches
def test_image_folder_resume_mid_epoch_ends_with_the_uninterrupted_weights(tmp_path):
    data = write_image_folder(tmp_path / "d", train=8, val=4)
    args = [
        *SMALL,
        "--data_dir",
        data,
        "--image_size",
        "20",
        "--hflip",
        "false",
        "--epochs",
        "2",
        "--log_every",
        "1",
    ]
    full, part = tmp_path / "full", tmp_path / "part"
    launch("cpu.yaml", [*args, "--output_dir", full])
    # 3 steps per epoch: 1 into epoch 2
    launch("cpu.yaml", [*args, "--output_dir", part, "--max_steps", "4"])
    proc = launch("cpu.yaml", [*args, "--output_dir", part, "--resume", "auto"])
    assert "step 4, 1 batches into the epoch" in proc.stderr
    a, b = load_file(full / "model.safetensors"), load_file(part / "model.safetensors")
    assert max((a[k].double() - b[k].double()).abs().max().item() for k in a) <= 1e-6
    assert rows(part)[-1]["test_acc"] == rows(full)[-1]["test_acc"]
    for a, b in zip(rows(full), rows(part)):
        # epoch 2's row too: the sums of its step before the stop were kept
        assert (b["train_samples"], b["train_acc"]) == (a["train_samples"], a["train_acc"])
        assert b["train_loss"] == pytest.approx(a["train_loss"], abs=1e-6)
    steps_full = [json.loads(r) for r in (full / "steps.jsonl").read_text().splitlines()]
    steps_part = [json.loads(r) for r in (part / "steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps_part] == list(range(1, 7))
    assert all(abs(x["loss"] - y["loss"]) < 1e-6 for x, y in zip(steps_full, steps_part))


def test_sample_limits_on_a_folder_keep_every_class(tmp_path):
    root = write_image_folder(tmp_path / "d")
    data = build_data(
        TrainConfig(
            data="imagefolder",
            data_dir=str(root),
            image_size=16,
            train_samples=6,
            test_samples=3,
            batch_size=2,
        ),
        "cpu",
    )
    _, y = data.inputs(torch.arange(6), train=True)
    assert data.train_size == 6 and data.test_size == 3 and sorted(set(y.tolist())) == [0, 1, 2]


def test_a_file_rewritten_with_its_old_mtime_is_decoded_again_not_read_from_the_cache(
    tmp_path, monkeypatch
):
    """The cache's promise: a changed folder gets a new cache, never a stale one. A file rewritten
    with other contents and another size whose mtime is then restored (cp -p, rsync -a, tar x keep
    mtimes) must not be read from the old cache (the file size is in the key)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
    root = write_image_folder(tmp_path / "d", train=2, val=1)
    kw = dict(
        data="imagefolder",
        data_dir=str(root),
        image_size=16,
        batch_size=2,
        pipeline="cache",
        num_workers=0,
    )
    first = build_data(TrainConfig(**kw), "cpu")
    target = sorted((root / "train" / "apple").iterdir())[0]
    st = os.stat(target)
    # another size
    Image.new("RGB", (41, 23), (250, 10, 10)).save(target, format=Image.open(target).format)
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(target).st_size != st.st_size and os.stat(target).st_mtime_ns == st.st_mtime_ns
    again = build_data(TrainConfig(**kw), "cpu")
    assert again.train_loader.dataset.split.cache != first.train_loader.dataset.split.cache
    assert torch.equal(
        again.train_loader.dataset.images([0])[0],
        decode_image(target, again.train_loader.dataset.split.decode),
    )


def test_a_valid_folder_is_the_evaluation_split(tmp_path):
    """Roboflow's and many Kaggle sets' `valid/` is the evaluation split."""
    root = write_image_folder(tmp_path / "d", train=2, val=1, eval_dir="valid")
    # (--data: inferred)
    data = build_data(TrainConfig(data_dir=str(root), image_size=16, batch_size=2), "cpu")
    assert data.test_size == 3 and data.train_size == 6


def test_an_image_past_the_pixel_limit_is_named_with_its_size_before_it_is_decoded(
    tmp_path, monkeypatch
):
    """A 20 KB 1-bit PNG of 169 M pixels (under Pillow's own limit) took 1.6 GB to decode; past the
    project's limit it is an unreadable file like any other, named with its size, at the header read
    of the cpu pipeline too. A JPEG counts as its reduced-scale decode."""
    from accel_train.data import images
    from accel_train.data.images import UnreadableImage, check_images, decode_all

    # (the real limit: 64 M, as the message says)
    monkeypatch.setattr(images, "MAX_DECODED_PIXELS", 1_000_000)
    big, ok, photo = tmp_path / "big.png", tmp_path / "ok.png", tmp_path / "photo.jpg"
    Image.new("1", (1250, 1000)).save(big)  # 1.25 M pixels
    Image.new("RGB", (1000, 1000)).save(ok)
    Image.new("RGB", (4000, 3000)).save(photo)  # 12 M pixels, decoded at 1/8 scale: 0.19 M
    for read in (check_images, lambda files: decode_all(files, 32)):
        with pytest.raises(
            UnreadableImage,
            match=rf"{big} is not a readable image \(1250x1000, 1 M pixels to "
            r"decode, over accel_train's limit of 1 M: downscale it\); replace or remove it",
        ):
            read([ok, big, photo])
    assert decode_image(photo, 32).shape == (3, 32, 32) and len(check_images([ok, photo])) == 2


def test_an_image_far_smaller_than_its_decoded_size_is_said_once_with_the_smallest_named(
    tmp_path, caplog
):
    """A 1-pixel image was upscaled to the training size without a word."""
    from accel_train.data.images import Decode, check_images, decode_all

    files = []
    for name, side in (("dot", 1), ("small", 7), ("fine", 12), ("big", 40)):
        files.append(tmp_path / f"{name}.png")
        Image.new("RGB", (side, side + 1)).save(files[-1])
    for read in (
        lambda: check_images(files, Decode(32)),
        lambda: decode_all(files, 32, say_small=True),
    ):
        caplog.clear()
        with caplog.at_level("WARNING", logger="accel_train"):
            read()
        said = [r.getMessage() for r in caplog.records if "far smaller" in r.getMessage()]
        assert said == [
            "2 images of 4 are far smaller than the 32 px they are decoded at (shorter side under"
            f" 8 px; the smallest: {files[0]}, 1x2): upscaled, with little detail to learn from;"
            " remove them, or pass a smaller --image_size"
        ], said
    caplog.clear()
    with caplog.at_level("WARNING", logger="accel_train"):
        # (no size, not asked, none small)
        (
            check_images(files),
            decode_all(files, 32),
            check_images(files[2:], 32),
        )
    assert not [r for r in caplog.records if "far smaller" in r.getMessage()]


def test_classes_far_apart_in_size_are_said_at_start():
    """Classes of 1 and 200 images trained without a note."""
    from accel_train.data.load import imbalance

    said = imbalance(["狗", "cat", "cow"], [0] + [1] * 200 + [2] * 50)
    assert (
        said
        == "unbalanced classes: '狗' has 1 training image, 'cat' 200; the loss weighs every image"
        " alike, so the accuracy is mostly the large classes' (evaluate's per-class table shows"
        " each)"
    )
    assert imbalance(["a", "b"], [0] * 10 + [1] * 99) is None and imbalance(
        ["a", "b"], [0] * 10 + [1] * 100
    )


def _photo(path, w, h, seed=0):
    """A photo-like image: smooth shading plus grain (what a resize's kernel shows on)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    shading = (
        128 + 90 * np.sin(x / 17 + 1) * np.cos(y / 23) + 30 * np.sin(x / 3.1) * np.sin(y / 2.7)
    )
    pixels = shading[..., None] * rng.uniform(0.4, 1.0, 3) + rng.normal(0, 8, (h, w, 3))
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(path)
    return path


def test_the_whole_image_store_is_pillows_bilinear_resize_within_a_level(tmp_path, monkeypatch):
    from accel_train.data import images
    from accel_train.data.images import Decode

    path = _photo(tmp_path / "p.png", 230, 170)
    pillow = np.asarray(Image.open(path).convert("RGB").resize((96, 96), Image.BILINEAR)).astype(
        int
    )
    for kernel in ("torch", "pillow"):
        monkeypatch.setattr(images, "squash_kernel", lambda kernel=kernel: kernel)
        got = decode_image(path, Decode(96, whole=True))
        assert got.shape == (3, 96, 96) and got.is_contiguous()
        diff = np.abs(got.permute(1, 2, 0).numpy().astype(int) - pillow)
        assert diff.max() <= 1 and diff.mean() < 0.05, (kernel, diff.max(), diff.mean())
        if kernel == "pillow":
            assert diff.max() == 0
        view = decode_image(path, Decode(96, whole=True), channels_last=True)
        assert torch.equal(view, got) and view.permute(1, 2, 0).is_contiguous()
    square = _photo(tmp_path / "s.png", 96, 96)  # (already the store's size: as decoded)
    assert np.array_equal(
        decode_image(square, Decode(96, whole=True)).permute(1, 2, 0).numpy(),
        np.asarray(Image.open(square).convert("RGB")),
    )
    monkeypatch.setattr(images, "squash_kernel", lambda: "torch")
    monkeypatch.setattr(images, "SQUASH_PIXELS", 1)  # (a large image: Pillow's, from its buffer)
    assert np.array_equal(
        decode_image(path, Decode(96, whole=True)).permute(1, 2, 0).numpy(), pillow.astype(np.uint8)
    )


def test_the_squash_kernel_follows_the_cpus_vector_units_and_keys_the_cache(tmp_path, monkeypatch):
    from accel_train.data import cache, images

    for capability, kernel in (
        ("AVX512", "torch"),
        ("AVX2", "torch"),
        ("DEFAULT", "pillow"),
        ("SVE256", "pillow"),
    ):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        assert images.squash_kernel() == kernel
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
    files = [_photo(tmp_path / "a.png", 40, 30)]
    keys = set()
    for kernel in ("torch", "pillow"):
        monkeypatch.setattr(cache, "squash_kernel", lambda k=kernel: k)
        keys.add(cache.cache_path(files, 16).name)
    assert len(keys) == 2  # (a store made by another kernel is another cache)
