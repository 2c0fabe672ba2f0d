"""Image folders and the decoded cache at the edges: a small disk, replaced files,
subsets, stacked mounts, hidden folders, small classes."""

import os
import subprocess
from collections import namedtuple

import numpy as np
import pytest
import torch
from conftest import clean_env, launch, run_cli
from PIL import Image
from test_imagefolder import SMALL, write_image_folder

from accel_train.config.train_config import TrainConfig
from accel_train.data import build_data, cache, decode_image
from accel_train.data.folders import scan_split, subset
from accel_train.platform import cores


def cache_files(home):
    return sorted(p.name for p in (home / "accel_train/decoded").glob("*.npy"))


def small_disk(tmp_path, monkeypatch, size: int):
    """A cache home on a disk of `size` bytes: a tmpfs where this machine lets us mount one, else
    the free-space figure of such a disk (its size less the files written into it). -> (home,
    unmount)."""
    home = tmp_path / "small"
    home.mkdir()
    try:
        mounted = (
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(home)],
                capture_output=True,
                timeout=30,
            ).returncode
            == 0
        )
    except OSError:  # (no mount command)
        mounted = False
    if mounted:
        return home, lambda: subprocess.run(
            ["umount", "-l", str(home)], capture_output=True, timeout=30
        )
    usage = namedtuple("usage", "total used free")

    def disk_usage(path):
        used = sum(-(-f.stat().st_size // 4096) * 4096 for f in home.rglob("*") if f.is_file())
        return usage(size, used, size - used)

    monkeypatch.setattr(cache.shutil, "disk_usage", disk_usage)
    return home, lambda: None


def test_auto_keeps_using_its_complete_cache_on_a_disk_with_room_for_one(tmp_path, monkeypatch):
    # the free-space check does not count the complete cache's own size against it: start 1 writes
    # it, start 2 and every later one read it, never "nor the local disk (... GiB free)" and a
    # decode per sample (several starts on a disk with room for one cache only)
    root = write_image_folder(tmp_path / "d", train=40, val=2)
    # (64 px stored)
    kw = dict(
        data="imagefolder",
        data_dir=str(root),
        image_size=64,
        batch_size=4,
        num_workers=0,
        device_data_mb=0.001,
        mean="0.5,0.5,0.5",
        std="0.25,0.25,0.25",
        train_crop="pad",
    )
    nbytes = 126 * 3 * 64 * 64  # (40 + 2) x 3 classes
    room = int(cache.ROOM[1] + 1.5 * nbytes)  # room for 1.1x + 1 GiB, not for 2.1x + 1 GiB
    home, unmount = small_disk(tmp_path, monkeypatch, room - room % 4096)
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    try:
        first = build_data(TrainConfig(**kw), "cpu")
        assert first.pipeline == "cache" and "the local disk has room" in first.describe(), (
            first.describe()
        )
        assert len(cache_files(home)) == 2
        for _ in range(2):
            again = build_data(TrainConfig(**kw), "cpu")
            assert again.pipeline == "cache", again.describe()
            assert "decoded in the local disk's cache already" in again.describe()
            assert again.describe().count("written by an earlier run: read, not decoded") == 2
        # a cache still to write is still judged by the free space: another size does not fit beside
        # it
        other = build_data(TrainConfig(**{**kw, "image_size": 72}), "cpu")
        assert other.pipeline == "cpu" and "nor the local disk" in other.describe()
    finally:
        unmount()


def test_a_file_replaced_with_the_same_size_and_mtime_is_decoded_again(tmp_path, monkeypatch):
    # a key of (path, size, mtime_ns) alone is not enough: cp -p, rsync -a, tar x and touch -r keep
    # the mtime, and an image replaced by another of the same size must not be read from the
    # cache, stale (the mtime kept here)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
    root = write_image_folder(tmp_path / "d", train=4, val=2)
    # (BMP: the same size for the same width and height)
    target = root / "train" / "apple" / "a.bmp"
    Image.fromarray(np.full((24, 24, 3), 40, np.uint8)).save(target)
    kw = dict(
        data="imagefolder",
        data_dir=str(root),
        image_size=16,
        batch_size=4,
        pipeline="cache",
        num_workers=0,
    )
    first = build_data(TrainConfig(**kw), "cpu")
    index = first.train_loader.dataset.split.files.index(target)
    assert (first.train_loader.dataset.images([index]) == 40).all()
    reference = tmp_path / "mtime"
    subprocess.run(["touch", "-r", str(target), str(reference)], check=True, timeout=30)
    replacement = tmp_path / "new.bmp"
    for level, copy in (
        (215, "cp"),
        (90, "mv"),
    ):
        # (cp: the same inode, a new ctime; mv: another inode)
        Image.fromarray(np.full((24, 24, 3), level, np.uint8)).save(replacement)
        assert replacement.stat().st_size == target.stat().st_size
        subprocess.run([copy, str(replacement), str(target)], check=True, timeout=30)
        subprocess.run(["touch", "-r", str(reference), str(target)], check=True, timeout=30)
        assert target.stat().st_mtime_ns == reference.stat().st_mtime_ns
        again = build_data(TrainConfig(**kw), "cpu")
        assert "train: decoded cache" in again.describe() and "written once" in again.describe(), (
            again.describe()
        )
        assert (again.train_loader.dataset.images([index]) == level).all()
        assert torch.equal(
            again.train_loader.dataset.images([index])[0],
            decode_image(target, again.train_loader.dataset.split.decode),
        )


def test_runs_with_different_sample_limits_keep_each_others_caches(tmp_path, monkeypatch):
    # a --train_samples run and a full one keep each other's cache (a subset is not a changed
    # folder); a changed folder replaces its cache
    home = tmp_path / "home"
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    root = write_image_folder(tmp_path / "d", train=4, val=2)
    kw = dict(
        data="imagefolder",
        data_dir=str(root),
        image_size=16,
        batch_size=2,
        pipeline="cache",
        num_workers=0,
    )
    smoke = dict(kw, train_samples=6, test_samples=3)
    for cfg in (smoke, kw, smoke, kw):
        data = build_data(TrainConfig(**cfg), "cpu")
    assert data.describe().count("read, not decoded") == 2 and len(cache_files(home)) == 4
    assert "read, not decoded" in build_data(TrainConfig(**smoke), "cpu").describe()
    # a changed folder: each run's cache is replaced by one
    (root / "train" / "apple" / "img_000.png").unlink()
    for cfg in (smoke, kw):
        build_data(TrainConfig(**cfg), "cpu")
    assert len(cache_files(home)) == 4
    assert (
        sum(
            np.load(home / "accel_train/decoded" / name, mmap_mode="r").shape[0] == 11
            for name in cache_files(home)
        )
        == 1
    )


def test_a_mount_stacked_over_another_is_judged_by_the_top_one(tmp_path, monkeypatch):
    # of equal mount points the last (the visible upper one) counts, not the hidden lower one: an
    # automounted NFS home is remote; so are autofs, virtiofs and wekafs (several mounts per
    # point)
    mounts = tmp_path / "mounts"
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    stacks = {
        "nfs4": (
            f"/dev/sda1 / ext4 rw 0 0\n/dev/sdb1 {tmp_path} ext4 rw 0 0\nserver:/h {tmp_path} nfs4"
            " rw 0 0\n"
        ),
        "ext4": (
            f"/dev/sda1 / ext4 rw 0 0\nsystemd-1 {tmp_path} autofs rw 0 0\n/dev/sdb {tmp_path} ext4"
            " rw 0 0\n"
        ),
    }
    for top, table in stacks.items():
        mounts.write_text(table)
        assert cache.file_system(home, str(mounts)) == top
    assert cache.no_room(1, str(mounts)) is None
    for kind in ("autofs", "virtiofs", "wekafs", "nfs4", "fuse.sshfs"):
        mounts.write_text(f"/dev/sda1 / ext4 rw 0 0\nx {tmp_path} {kind} rw 0 0\n")
        assert f"is {kind}, not local" in cache.no_room(1, str(mounts))


def test_files_in_hidden_folders_are_skipped(tmp_path):
    # hidden folders are skipped as hidden files are: macOS's .AppleDouble/ (not images: exit 2)
    # and a viewer's .thumbnails/ (trained as the class) are not read
    root = write_image_folder(tmp_path / "d", train=3, val=1)
    before = scan_split(root / "train")
    (root / "train/apple/.AppleDouble").mkdir()
    (root / "train/apple/.AppleDouble/00000.jpg").write_bytes(b"\x00\x05\x16\x07 not an image")
    (root / "train/apple/.thumbnails/normal").mkdir(parents=True)
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(
        root / "train/apple/.thumbnails/normal/x.jpg"
    )
    (root / "train/apple/sub").mkdir()  # (a visible subfolder is still read)
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(root / "train/apple/sub/y.jpg")
    classes, files, labels = scan_split(root / "train")
    assert (
        classes == before[0]
        and files == sorted(before[1][:3] + [root / "train/apple/sub/y.jpg"]) + before[1][3:]
    )
    assert (
        build_data(
            TrainConfig(data="imagefolder", data_dir=str(root), image_size=16, batch_size=2), "cpu"
        ).train_size
        == 10
    )


def test_image_links_that_lead_nowhere_are_said_and_skipped(tmp_path, caplog):
    root = write_image_folder(tmp_path / "d", train=3, val=1)
    before = scan_split(root / "train")
    os.symlink(tmp_path / "gone.png", root / "train/apple/dangling.png")
    os.symlink(root / "train/apple/loop.png", root / "train/apple/loop.png")
    with caplog.at_level("WARNING", logger="accel_train"):
        assert scan_split(root / "train") == before
    said = [r.getMessage() for r in caplog.records if "image links to nothing" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(
        f"{root / 'train'}: skipped 2 image links to nothing"
    ), said
    assert "dangling.png" in said[0] and "loop.png" in said[0]


def test_sample_limits_keep_a_small_class(tmp_path):
    # N evenly spaced files of the whole folder would step over a class of 3 between two of 1000
    # for every N from 50 to 500: classes of unequal size
    labels = [0] * 1000 + [1] * 3 + [2] * 1000
    files = [f"f{i}" for i in range(len(labels))]
    for n in (3, 50, 101, 500, 2000):
        chosen, kept = subset(files, labels, n)
        assert len(chosen) == n == len(set(chosen)) and np.bincount(kept).min() >= 1, n
        assert all(
            files.index(f) in np.flatnonzero(np.asarray(labels) == y) for f, y in zip(chosen, kept)
        )
    # (the rest as the folder's shares)
    assert np.bincount(subset(files, labels, 500)[1]).tolist() == [
        250,
        1,
        249,
    ]
    assert subset(files, labels, None) == (files, labels) and len(subset(files, labels, 2)[0]) == 2
    root = write_image_folder(tmp_path / "d", train=2, val=1, classes={"a": 40, "b": 128, "c": 215})
    for f in sorted((root / "train/b").iterdir())[1:]:
        f.unlink()
    for name in ("a", "c"):
        write_image_folder(tmp_path / "d", train=12, val=1, classes={name: 40})
    data = build_data(
        TrainConfig(
            data="imagefolder", data_dir=str(root), image_size=16, train_samples=5, batch_size=5
        ),
        "cpu",
    )
    _, y = data.inputs(torch.arange(5), train=True)
    assert sorted(set(y.tolist())) == [0, 1, 2]


def test_the_cache_pipelines_mean_and_std_are_the_device_pipelines_read_not_decoded(
    tmp_path, monkeypatch
):
    # the cache pipeline does not decode a sample of the training files again at every start for
    # mean/std (a sample: at >= STATS_SAMPLE images other numbers than the device pipeline's, which
    # uses every image); here without --mean/--std and with more images than the sample
    from accel_train.data import load

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(load, "STATS_SAMPLE", 4)  # (as a folder of more than 2048 images)
    root = write_image_folder(tmp_path / "d", train=8, val=2)
    kw = dict(data="imagefolder", data_dir=str(root), image_size=16, batch_size=4, num_workers=0)
    device = build_data(TrainConfig(**kw), "cpu")
    assert device.pipeline == "device"
    first = build_data(TrainConfig(pipeline="cache", **kw), "cpu")
    assert (first.info.mean, first.info.std) == (device.info.mean, device.info.std)

    def no_decoding(*args, **kwargs):
        raise AssertionError("decoded")

    monkeypatch.setattr(load, "decode_all", no_decoding)
    # (nor the whole cache read again: its stats are kept)
    monkeypatch.setattr(load, "channel_stats", no_decoding)
    again = build_data(TrainConfig(pipeline="cache", **kw), "cpu")
    assert (again.info.mean, again.info.std) == (device.info.mean, device.info.std)
    # a rank that took another mean/std (its machine's cache not yet written) takes rank 0's before
    # the first batch
    again.set_normalisation((0.1, 0.2, 0.3), (0.5, 0.5, 0.5))
    images = again.test_loader.dataset.images([0, 1, 2, 3]).float() / 255
    y, _ = again.inputs(again.test_loader.dataset.__getitems__([0, 1, 2, 3]), train=False)
    assert again.info.mean == (0.1, 0.2, 0.3)
    assert torch.allclose(
        y, (images - torch.tensor([0.1, 0.2, 0.3]).view(1, 3, 1, 1)) / 0.5, atol=1e-5
    )


def truncated(root, split="val"):
    """A JPEG whose header reads (check_images passes) but whose pixels end early (only a decode
    finds it)."""
    jpeg = root / split / "cherry-2" / "img_001.jpg"
    data = jpeg.read_bytes()
    jpeg.write_bytes(data[: len(data) - 150])
    return jpeg


def one_error_line(proc, jpeg):
    # (its "worst relative error", under the bf16 CPU facts)
    errors = [
        line
        for line in proc.stderr.splitlines()
        if "error" in line.lower()
        and "ChildFailedError" not in line
        and not line.lstrip().startswith(
            ("error_file", "traceback :", "E1", "raise ChildFailedError")
        )
        and "precision check:" not in line
    ]
    assert len(errors) == 1 and errors[0].startswith(
        f"accel-train: error: {jpeg} is not a readable image (image file is truncated"
    ), proc.stderr[-4000:]
    assert "Traceback" not in proc.stdout + "\n".join(
        line for line in proc.stderr.splitlines() if "[RANK" in line
    )


def test_a_truncated_jpeg_found_by_a_dataloader_worker_is_one_line_and_exit_2(
    tmp_path, monkeypatch
):
    # UnreadableImage(path, reason) is rebuilt by torch's ExceptionWrapper (one argument): a
    # worker's truncated JPEG is one line, not a RuntimeError, a traceback and exit 1 after an
    # epoch (with workers, and a file whose header reads, which check_images would name at start).
    # Here the start-up check is bypassed (STATS_SAMPLE 1: as a split too large to
    # decode at start) so that a worker finds it.
    from accel_train.data import load

    monkeypatch.setattr(load, "STATS_SAMPLE", 1)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
    root = write_image_folder(tmp_path / "d", train=8, val=4)
    jpeg = truncated(root)
    out = tmp_path / "out"
    proc = run_cli(
        [
            *SMALL,
            "--data_dir",
            root,
            "--epochs",
            "1",
            "--output_dir",
            out,
            "--pipeline",
            "cpu",
            "--num_workers",
            "2",
            "--mean",
            "0.5,0.5,0.5",
            "--std",
            "0.25,0.25,0.25",
            "--batch_size",
            "4",
        ]
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    one_error_line(proc, jpeg)
    # (found by the evaluation's worker, after the epoch's steps)
    assert "epoch 1/1" not in proc.stderr


@pytest.mark.launches
def test_a_truncated_jpeg_is_found_at_start_on_every_rank(tmp_path):
    # on 2 ranks: a bad training file with --mean/--std given (no statistics decode) is not left for
    # one rank's worker to find mid-run (that rank's traceback, exit 1, the other rank's survivor
    # save, exit 3). A split of up to 2048 files is decoded at start:
    # the same one line and exit 2 on every rank
    root = write_image_folder(tmp_path / "d", train=40, val=4)
    jpeg = truncated(root, "train")
    status, out = tmp_path / "status", tmp_path / "out"
    status.mkdir()
    proc = launch(
        "2proc_cpu.yaml",
        [
            *SMALL,
            "--data_dir",
            root,
            "--epochs",
            "1",
            "--output_dir",
            out,
            "--pipeline",
            "cpu",
            "--num_workers",
            "2",
            "--mean",
            "0.5,0.5,0.5",
            "--std",
            "0.25,0.25,0.25",
            "--batch_size",
            "4",
        ],
        check=False,
        env=clean_env(XDG_CACHE_HOME=str(tmp_path / "home"), ACCEL_TRAIN_STATUS_DIR=str(status)),
    )
    assert proc.returncode != 0
    assert sorted(f.read_text().strip() for f in status.iterdir() if f.is_file()) == [
        "2",
        "2",
    ], proc.stderr[-4000:]
    one_error_line(proc, jpeg)
    assert not (out / "checkpoints").exists()


def test_a_live_writers_locked_file_is_kept_and_a_cache_published_meanwhile_is_taken(
    tmp_path, monkeypatch
):
    # a writer in another PID namespace with the same hostname (containers with --network host
    # sharing ~/.cache): its pid does not run here, yet its temporary file stays, since liveness is
    # its flock. And a complete cache of the same key that such a writer publishes meanwhile is
    # taken, the rest not decoded
    import socket
    import sys
    import textwrap

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
    root = write_image_folder(tmp_path / "d", train=20, val=2)
    files = scan_split(root / "train")[1]
    path = cache.cache_path(files, 16)
    path.parent.mkdir(parents=True)
    # (a pid that runs in the writer's namespace, not here)
    other = path.with_name(
        f".{path.name.rsplit('-', 1)[0]}-ffffffffffffffffffff.npy.{socket.gethostname()}."
        f"{2**22 + 1}.tmp"
    )
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import fcntl, sys, time
        f = open({str(other)!r}, "wb")
        fcntl.flock(f, fcntl.LOCK_EX)
        print("locked", flush=True)
        time.sleep(60)"""),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        cache.remove_abandoned(path)
        assert other.exists()
    finally:
        holder.kill()
        holder.wait(timeout=30)
    cache.remove_abandoned(path)
    assert not other.exists()  # (its writer gone: abandoned)
    decode, calls = cache.decode_all, []

    def another_writer_publishes(chunk, size, **kw):
        calls.append(len(chunk))
        if len(calls) == 2:
            np.save(path, decode(files, size)[0].permute(0, 2, 3, 1).numpy())
        return decode(chunk, size)

    monkeypatch.setattr(cache, "decode_all", another_writer_publishes)
    monkeypatch.setattr(cache, "CHUNK", 16)
    note = cache.write_cache(files, 16, path)
    assert note.endswith(
        "written meanwhile by another process: read, 32 of 60 images decoded here"
    ), note
    assert len(calls) == 2 and not list(path.parent.glob(".*"))


def test_the_decode_answers_the_stop_its_caller_names_and_nothing_else(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
    # the data layer imports no signal handling: what it answers is the should_stop it is given
    from accel_train.data.images import decode_all
    from accel_train.errors import Preempted

    files = sorted((write_image_folder(tmp_path / "d", train=4, val=1) / "train").rglob("*.png"))
    asked = []
    with pytest.raises(
        Preempted, match=f"stopped by SIGUSR1 while decoding {len(files)} images at start-up"
    ):
        decode_all(files, 16, should_stop=lambda: asked.append(1) or "SIGUSR1")
    assert asked
    assert decode_all(files, 16)[0].shape == (len(files), 3, 16, 16)  # (none given: never stops)
    path = cache.cache_path(files, 16)
    with pytest.raises(Preempted, match="stopped by SIGUSR1 while decoding the cache"):
        cache.write_cache(files, 16, path, should_stop=lambda: "SIGUSR1")
    assert not path.exists()


def test_a_stop_signal_during_the_first_decode_is_answered_and_the_next_start_continues_it(
    tmp_path, monkeypatch
):
    # a SIGTERM during the decode of the cache is not left until start-up ends (ImageNet's ~49 min
    # decode: SIGKILLed by torchrun 30 s later, then decoded again from zero): it is answered
    # between pieces of about half a second (exit 4), the rows decoded so far are
    # kept, and the next start continues from them
    import os
    import signal

    from accel_train.data import load

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
    root = write_image_folder(tmp_path / "d", train=20, val=2)
    decode, calls = cache.decode_all, []

    def signalled_during_the_first(chunk, size, **kw):
        calls.append(len(chunk))
        images = decode(chunk, size, **kw)
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # (the trainer's handler records it)
        return images

    monkeypatch.setattr(cache, "decode_all", signalled_during_the_first)
    # (the training split decoded at 16 px: cache_path below)
    args = [
        *SMALL,
        "--data_dir",
        root,
        "--epochs",
        "1",
        "--output_dir",
        tmp_path / "out",
        "--pipeline",
        "cache",
        "--num_workers",
        "0",
        "--train_crop",
        "pad",
    ]
    proc = run_cli(args)
    assert proc.returncode == 4, proc.stderr[-3000:]
    assert (
        "stopped by SIGTERM while decoding the cache" in proc.stderr
        and "(16 of 60 images)" in proc.stderr
    )
    assert calls == [16]
    kept = list((tmp_path / "home/accel_train/decoded").glob(".*.tmp"))
    assert len(kept) == 1 and not list((tmp_path / "home/accel_train/decoded").glob("*.npy"))
    calls.clear()
    monkeypatch.setattr(
        cache,
        "decode_all",
        lambda chunk, size, **kw: calls.append(len(chunk)) or decode(chunk, size),
    )
    proc = run_cli(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # (the rest, then val)
    assert "continued from image 17" in proc.stderr and sum(calls) == 60 - 16 + 6, calls
    train = load.scan_split(root / "train")[1]
    cached = np.load(cache.cache_path(train, 16), mmap_mode="r")
    assert (
        np.array_equal(cached, decode(train, 16)[0].permute(0, 2, 3, 1).numpy())
        and not kept[0].exists()
    )


def test_workers_follow_a_cgroup_cpu_quota_and_the_cache_key_pillows_version(tmp_path, monkeypatch):
    # suspected, verified: worker_count used the CPU affinity only, so a container limited by a CFS
    # quota (docker
    # --cpus, Kubernetes limits: cgroup cpu.max) of 2 cores out of 64 still started 8 workers per
    # loader; and a Pillow upgrade (another decode) kept reading the old caches
    proc = tmp_path / "cgroup"
    v2 = tmp_path / "v2"
    (v2 / "kubepods/pod1").mkdir(parents=True)
    (v2 / "kubepods/cpu.max").write_text("250000 100000\n")  # 2.5 cores: 3
    (v2 / "kubepods/pod1/cpu.max").write_text("max 100000\n")
    proc.write_text("0::/kubepods/pod1\n")
    assert cores.cpu_quota(str(proc), str(v2)) == 3
    proc.write_text("0::/\n")
    (v2 / "cpu.max").write_text("max 100000\n")
    assert cores.cpu_quota(str(proc), str(v2)) is None
    v1 = tmp_path / "v1/cpu,cpuacct/docker/abc"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("200000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    proc.write_text("4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n")
    assert cores.cpu_quota(str(proc), str(tmp_path / "v1")) == 2
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setattr(cores, "cpu_quota", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    n, why = cores.worker_count(None)
    assert (
        n == 2 and "2 cores of its cgroup's CPU quota (64 in its CPU affinity) / 1 process" in why
    ), why
    files = [write_image_folder(tmp_path / "d", train=1, val=1) / "train/apple/img_000.png"]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
    before = cache.cache_path(files, 16)
    monkeypatch.setattr("PIL.__version__", "99.0.0")
    assert cache.cache_path(files, 16) != before


@pytest.mark.launches
def test_a_truncated_jpeg_met_mid_run_by_one_rank_is_exit_2_on_every_rank(tmp_path):
    # a split too large to decode at start (> 2048 files): one rank's worker meets the file in the
    # evaluation; that rank says it and exits 2, and leaves a note in the output dir, so that its
    # peer, which only sees it gone, says the same file, exit 2 (not "lost contact with a peer",
    # 3)
    root = write_image_folder(tmp_path / "d", train=8, val=700)
    jpeg = truncated(root)
    status, out = tmp_path / "status", tmp_path / "out"
    status.mkdir()
    proc = launch(
        "2proc_cpu.yaml",
        [
            *SMALL,
            "--data_dir",
            root,
            "--epochs",
            "1",
            "--output_dir",
            out,
            "--pipeline",
            "cpu",
            "--num_workers",
            "1",
            "--mean",
            "0.5,0.5,0.5",
            "--std",
            "0.25,0.25,0.25",
            "--batch_size",
            "4",
        ],
        check=False,
        env=clean_env(XDG_CACHE_HOME=str(tmp_path / "home"), ACCEL_TRAIN_STATUS_DIR=str(status)),
    )
    assert sorted(f.read_text().strip() for f in status.iterdir() if f.is_file()) == [
        "2",
        "2",
    ], proc.stderr[-4000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("accel-train: error: ")]
    assert len(lines) == 2 and all(
        line.startswith(
            f"accel-train: error: {jpeg} is not a readable image (image file is truncated"
        )
        for line in lines
    ), proc.stderr[-4000:]
    assert "lost contact" not in proc.stderr and "Traceback" not in "\n".join(
        line for line in proc.stderr.splitlines() if "[RANK" in line
    )


def test_the_cpu_device_budget_is_shared_by_the_machines_processes(monkeypatch):
    # suspected, verified: on a CPU device each local rank holds its own copy of the decoded data,
    # yet each was allowed a quarter of the machine's free memory: 4 local ranks could take all of
    # it (the old test had one process)
    from accel_train.data.load import device_budget

    real = os.sysconf
    monkeypatch.setattr(
        "os.sysconf", lambda name: 4000 if name == "SC_AVPHYS_PAGES" else real(name)
    )
    page = real("SC_PAGE_SIZE")
    for local in (1, 4):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
        assert device_budget(None, "cpu") == 4000 * page // local // 4


def test_a_stop_signal_during_the_device_pipelines_decode_ends_it_at_once(tmp_path, monkeypatch):
    # the device pipeline: its decode of every image (and the statistics' and the start check's)
    # does not run to its end before the start-up check sees the signal: the decode's pool passes
    # over the rest
    import os
    import signal

    from accel_train.data import images

    root = write_image_folder(tmp_path / "d", train=40, val=2)
    decode, calls = images.decode_image, []

    def signalled(path, size, **kwargs):
        calls.append(path)
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return decode(path, size)

    monkeypatch.setattr(images, "decode_image", signalled)
    proc = run_cli(
        [
            *SMALL,
            "--data_dir",
            root,
            "--epochs",
            "1",
            "--output_dir",
            tmp_path / "out",
            "--pipeline",
            "device",
        ]
    )
    assert proc.returncode == 4, proc.stderr[-3000:]
    assert "stopped by SIGTERM while decoding 120 images at start-up" in proc.stderr, proc.stderr[
        -2000:
    ]
    # (the pool's threads: at most one image each after the signal)
    assert len(calls) <= 16, len(calls)
