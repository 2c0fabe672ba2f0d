import pickle

import numpy as np
import pytest
import torch
from conftest import Exploit, write_batch, write_cifar
from torchvision.transforms.v2 import functional as TF

from accel_train.config.train_config import TrainConfig
from accel_train.data import (
    DataError,
    build_data,
    crop_flip,
    crop_flip_params,
    random_data,
    read_batch,
    read_cifar10,
)


def test_reader_any_rows_per_file(tmp_path):
    write_cifar(tmp_path, rows=(7, 5, 6, 9, 3), test_rows=11)
    splits = read_cifar10(tmp_path)
    x, y = splits["train"]
    assert x.shape == (30, 3, 32, 32) and x.dtype == torch.uint8
    assert y.shape == (30,) and y.dtype == torch.int64 and 0 <= y.min() and y.max() <= 9
    assert splits["test"][0].shape == (11, 3, 32, 32)


def test_reader_keeps_channel_major_layout(tmp_path):
    d = tmp_path / "cifar-10-batches-py"
    d.mkdir()
    data = np.zeros((1, 3072), np.uint8)
    data[0, :1024] = 200  # red plane
    data[0, 1024 + 5] = 77  # green, row 0 column 5
    write_batch(d / "b", data, [3])
    x, y = read_batch(d / "b")
    assert (
        (x[0, 0] == 200).all() and x[0, 1, 0, 5] == 77 and x[0, 2].max() == 0 and y.tolist() == [3]
    )


@pytest.mark.parametrize(
    "data,labels,match",
    [
        (np.zeros((4, 3000), np.uint8), [0, 1, 2, 3], "N x 3072 uint8"),
        (np.zeros((4, 3072), np.float32), [0, 1, 2, 3], "N x 3072 uint8"),
        (np.zeros((4, 3072), np.uint8), [0, 1, 2], "expected 4 integer labels"),
        (np.zeros((3, 3072), np.uint8), [0, 10, 2], r"labels must be in 0\.\.9"),
        (np.zeros((3, 3072), np.uint8), [0, -1, 2], r"labels must be in 0\.\.9"),
    ],
)
def test_reader_rejects_bad_arrays(tmp_path, data, labels, match):
    write_cifar(tmp_path)
    write_batch(tmp_path / "cifar-10-batches-py" / "data_batch_3", data, labels)
    with pytest.raises(DataError, match=match):
        read_cifar10(tmp_path)


def test_reader_truncated_file(tmp_path):
    write_cifar(tmp_path)
    f = tmp_path / "cifar-10-batches-py" / "data_batch_2"
    f.write_bytes(f.read_bytes()[:-500])
    with pytest.raises(DataError, match="data_batch_2 is truncated or corrupt"):
        read_cifar10(tmp_path)


def test_reader_missing_split_and_dirs(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        read_cifar10(tmp_path / "nowhere")
    with pytest.raises(DataError, match="has no cifar-10-batches-py"):
        read_cifar10(tmp_path)
    write_cifar(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "test_batch").unlink()
    with pytest.raises(DataError, match="lacks test_batch"):
        read_cifar10(tmp_path)


def test_reader_refuses_code_in_pickle(tmp_path):
    write_cifar(tmp_path)
    marker = tmp_path / "pwned"
    payload = {b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 1], b"x": Exploit(marker)}
    with open(tmp_path / "cifar-10-batches-py" / "data_batch_1", "wb") as f:
        pickle.dump(payload, f, protocol=2)
    # sanity: the payload really would create the file under plain pickle
    with open(tmp_path / "cifar-10-batches-py" / "data_batch_1", "rb") as f:
        blob = f.read()
    with pytest.raises(DataError, match=r"refused global (posix|os|nt)\.system.*not executed"):
        read_cifar10(tmp_path)
    assert not marker.exists()
    pickle.loads(blob)
    assert marker.exists(), "the test payload is not a working exploit"


def test_random_data_deterministic_by_seed():
    a, b, c = random_data(20, 6, seed=1), random_data(20, 6, seed=1), random_data(20, 6, seed=2)
    for split in ("train", "test"):
        assert torch.equal(a[split][0], b[split][0]) and torch.equal(a[split][1], b[split][1])
        assert not torch.equal(a[split][0], c[split][0])
    assert a["train"][0].shape == (20, 3, 32, 32) and a["test"][1].shape == (6,)
    assert not torch.equal(a["train"][0][:6], a["test"][0])


def test_sample_limits_take_the_first_n(tmp_path):
    write_cifar(tmp_path)
    cfg = TrainConfig(data="cifar10", data_dir=str(tmp_path), train_samples=9, test_samples=4)
    data = build_data(cfg, "cpu")
    full = read_cifar10(tmp_path)
    assert data.train_size == 9 and data.test_size == 4
    x, y = data.inputs(torch.arange(4), train=False)
    ref = TF.normalize(
        full["test"][0][:4].float() / 255, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    )
    assert torch.allclose(x, ref, atol=1e-5) and torch.equal(y, full["test"][1][:4])


def test_device_crop_flip_matches_torchvision():
    images = torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8)
    top, left, flip = crop_flip_params(torch.arange(64), epoch=3, seed=7)
    out = crop_flip(images, top, left, flip)
    for i in range(64):
        # RandomCrop(32, padding=4)
        ref = TF.crop(TF.pad(images[i], [4]), int(top[i]), int(left[i]), 32, 32)
        if flip[i]:
            ref = TF.horizontal_flip(ref)
        assert torch.equal(out[i], ref), i


def test_augmentation_covers_its_ranges_uniformly():
    n = 90_000
    top, left, flip = crop_flip_params(torch.arange(n), epoch=0, seed=42)
    for offsets in (top, left):
        counts = torch.bincount(offsets, minlength=9)
        assert len(counts) == 9 and counts.min() > 0
        expected = n / 9
        chi2 = (((counts - expected) ** 2) / expected).sum().item()
        assert chi2 < 40, counts  # 8 dof: p < 1e-5 above 40
    assert abs(flip.float().mean().item() - 0.5) < 0.01
    # joint: crop rows and columns independent, and flips independent of the crop
    joint = torch.bincount(top * 9 + left, minlength=81).float()
    assert joint.min() > 0.8 * n / 81 and joint.max() < 1.2 * n / 81
    assert abs(flip[top == 0].float().mean().item() - 0.5) < 0.03
    # a new epoch draws new augmentations for the same samples; same (seed, epoch) draws the same
    t2, _, _ = crop_flip_params(torch.arange(n), epoch=1, seed=42)
    t3, _, _ = crop_flip_params(torch.arange(n), epoch=0, seed=42)
    assert (t2 != top).float().mean() > 0.8 and torch.equal(t3, top)


def test_device_pipeline_gathers_and_cpu_pipeline_matches_eval(tmp_path):
    write_cifar(tmp_path)
    kw = dict(data="cifar10", data_dir=str(tmp_path), batch_size=4)
    dev, cpu = (
        build_data(TrainConfig(**kw), "cpu"),
        build_data(TrainConfig(pipeline="cpu", **kw), "cpu"),
    )
    idx = next(iter(dev.test_loader))
    assert torch.equal(idx, torch.arange(4))
    xd, yd = dev.inputs(idx, train=False)
    xc, yc = cpu.inputs(next(iter(cpu.test_loader)), train=False)
    assert torch.allclose(xd, xc, atol=1e-5) and torch.equal(yd, yc)
    xt, _ = dev.inputs(idx, train=True, epoch=0)
    assert xt.shape == (4, 3, 32, 32) and xt.dtype == torch.float32
    assert not torch.allclose(xt, xd)  # augmented


@pytest.mark.parametrize("world", [2, 3])
def test_build_data_train_loader_shards_disjointly_and_reshuffles_per_epoch(world):
    """build_data's loaders as accelerator.prepare shards them (seedable sampler, rank r of
    `world`)."""
    from accelerate.data_loader import prepare_data_loader

    n, bs = 103, 8

    def epoch_batches(pipeline, epoch, num_workers=0):
        """[(what the loader yielded, labels)] over all ranks, rank by rank."""
        cfg = TrainConfig(
            train_samples=n,
            test_samples=13,
            batch_size=bs,
            pipeline=pipeline,
            num_workers=num_workers,
            augment=False,
        )
        data = build_data(cfg, "cpu")
        out = []
        for rank in range(world):
            shard = prepare_data_loader(
                data.train_loader,
                num_processes=world,
                process_index=rank,
                put_on_device=False,
                use_seedable_sampler=True,
                data_seed=5,
            )
            shard.set_epoch(epoch)
            out += [(b, data.inputs(b, train=True, epoch=epoch)[1]) for b in shard]
        return data, out

    data, batches = epoch_batches("device", 1)
    assert {len(y) for _, y in batches} == {bs}  # every step a full batch on every rank
    # the device pipeline yields sample indices
    seen = torch.cat([idx for idx, _ in batches]).tolist()
    assert len(seen) == len(set(seen)), "ranks saw the same sample"
    # the whole epoch, minus the incomplete last step
    assert len(seen) == (n // (bs * world)) * bs * world
    assert seen != sorted(seen), "the training order is not shuffled"
    labels = torch.cat([y for _, y in batches]).tolist()
    assert labels == data.inputs(torch.tensor(seen), train=True)[1].tolist()
    # f(seed, epoch)
    assert seen == torch.cat([idx for idx, _ in epoch_batches("device", 1)[1]]).tolist()
    # reshuffled per epoch
    assert seen != torch.cat([idx for idx, _ in epoch_batches("device", 2)[1]]).tolist()
    # the cpu pipeline (DataLoader workers) hands each rank the same samples in the same order
    _, cpu = epoch_batches("cpu", 1, num_workers=2)
    assert torch.cat([y for _, y in cpu]).tolist() == labels
    # the test loader keeps every sample once, in order, the last batch short
    assert (
        torch.cat([data.inputs(b, train=False)[1] for b in data.test_loader]).tolist()
        == data.inputs(torch.arange(13), train=False)[1].tolist()
    )


@pytest.mark.parametrize("world", [1, 2])
def test_cpu_pipeline_augments_each_epoch_anew_through_the_prepared_loader(world):
    """What training iterates: loop.epoch_batches over the loader accelerator.prepare shards (rank r
    of `world`, seedable sampler), epochs 0, 1, 2 in turn, then a resumed run's fresh loader 1 batch
    into epoch 2. The cpu pipeline's images of epoch e are the device pipeline's for e (whose
    inputs() is given the epoch) and differ from epoch 0's. (Accelerate's DataLoaderShard.set_epoch
    gives a sharded loader's epoch to its sampler only.) The cpu pipeline runs in 2 persistent
    workers, started in epoch 0: the later epochs must reach their copies.
    """
    from types import SimpleNamespace

    from accelerate.data_loader import prepare_data_loader, skip_first_batches

    from accel_train.training.loop import epoch_batches

    kw = dict(train_samples=24, test_samples=4, batch_size=4)

    def images(pipeline, epochs, done=0):
        """{epoch: this epoch's augmented images over all ranks, rank by rank} from one prepared
        loader per rank."""
        data = build_data(
            TrainConfig(pipeline=pipeline, num_workers=2 if pipeline == "cpu" else None, **kw),
            "cpu",
        )
        assert data.train_loader.persistent_workers == (pipeline == "cpu")
        out = {e: [] for e in epochs}
        for rank in range(world):
            loader = prepare_data_loader(
                data.train_loader,
                num_processes=world,
                process_index=rank,
                put_on_device=False,
                use_seedable_sampler=True,
                data_seed=42,
            )
            run = SimpleNamespace(
                train_loader=loader,
                state=SimpleNamespace(batch_in_epoch=done),
                batches_per_epoch=len(loader),
                accelerator=SimpleNamespace(skip_first_batches=skip_first_batches),
            )
            for e in epochs:
                out[e] += [data.inputs(b, train=True, epoch=e)[0] for b in epoch_batches(run, e)]
        return {e: torch.cat(x) for e, x in out.items()}

    cpu, device = images("cpu", (0, 1, 2)), images("device", (0, 1, 2))
    for e in (0, 1, 2):
        assert torch.allclose(cpu[e], device[e], atol=1e-5), (
            f"epoch {e}: the cpu pipeline augmented otherwise"
        )
    for e in (1, 2):
        assert not torch.allclose(cpu[e], cpu[0], atol=1e-3), f"epoch {e} augmented like epoch 0"
    resumed_cpu, resumed_device = images("cpu", (2,), done=1)[2], images("device", (2,), done=1)[2]
    assert len(resumed_cpu) == len(cpu[2]) - 4 * world
    assert torch.allclose(resumed_cpu, resumed_device, atol=1e-5)


def test_dataloader_workers_leave_stop_signals_to_the_trainer():
    # a worker of the cpu pipeline (a real process): Ctrl-C, SIGUSR1 and torchrun's SIGTERM leave it
    # serving the trainer's agreed stop and checkpoint; the DataLoader's own SIGTERM (a second one)
    # still ends it
    import multiprocessing
    import os
    import signal
    import time

    from accel_train.data.workers import _leave_signals_to_the_trainer

    def worker(ready):
        _leave_signals_to_the_trainer(0)
        ready.set()
        time.sleep(60)

    # the trainer's signal watch (survivor.py) reads a wakeup fd, which a forked worker inherits: a
    # worker's signals (the DataLoader's SIGTERM at the end of a run) must not reach it. Before: a
    # finished 2-rank run exited 3.
    read, write = os.pipe()
    os.set_blocking(read, False)
    os.set_blocking(write, False)
    previous = signal.set_wakeup_fd(write)
    ready = multiprocessing.get_context("fork").Event()
    proc = multiprocessing.get_context("fork").Process(target=worker, args=(ready,), daemon=True)
    proc.start()
    try:
        assert ready.wait(30)
        for signum in (signal.SIGINT, signal.SIGUSR1, signal.SIGTERM):
            os.kill(proc.pid, signum)
        proc.join(1)
        assert proc.is_alive()
        proc.terminate()  # what the DataLoader does to a worker that did not stop
        proc.join(10)
        assert not proc.is_alive() and proc.exitcode == -signal.SIGTERM
        try:
            written = set(os.read(read, 64))
        except BlockingIOError:  # nothing written: as it should be
            written = set()
        # (this process's own signals, e.g. the worker's SIGCHLD, may be there: not the worker's)
        assert not written & {
            signal.SIGINT,
            signal.SIGUSR1,
            signal.SIGTERM,
        }, "a worker's signals reached the fd"
    finally:
        signal.set_wakeup_fd(previous)
        os.close(read)
        os.close(write)
        if proc.is_alive():
            proc.kill()
    cfg = TrainConfig(pipeline="cpu", num_workers=2, train_samples=16, test_samples=8, batch_size=4)
    assert build_data(cfg, "cpu").train_loader.worker_init_fn is _leave_signals_to_the_trainer


def test_workers_default_to_the_cores_of_each_process_on_this_machine(monkeypatch):
    """--num_workers auto: the process's CPU affinity (os.sched_getaffinity) shared by the processes
    on this machine (LOCAL_WORLD_SIZE, read by Accelerate's get_cpu_distributed_information), at
    most MAX_WORKERS; given, as given.
    """
    from accel_train.config.train_config import MAX_WORKERS
    from accel_train.data.workers import _leave_signals_to_the_trainer, loader_kwargs
    from accel_train.platform.cores import worker_count

    for cores, local, expected in (
        (2, 1, 2),
        (2, 2, 1),
        (3, 4, 1),
        (16, 2, MAX_WORKERS),
        (64, 2, MAX_WORKERS),
    ):
        monkeypatch.setattr("os.sched_getaffinity", lambda pid, n=cores: set(range(n)))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
        n, why = worker_count(None)
        assert (
            n == expected
            and f"{cores} cores in this process's CPU affinity / {local} process" in why
        ), why
    assert "at most 8" in worker_count(None)[1] and worker_count(0)[0] == 0
    # an accelerator: pinned, persistent, prefetching
    kw = loader_kwargs(None, "cuda")
    assert (
        kw["pin_memory"]
        and kw["persistent_workers"]
        and kw["prefetch_factor"] >= 2
        and kw["num_workers"] == 8
    )
    assert kw["worker_init_fn"] is _leave_signals_to_the_trainer
    assert loader_kwargs(None, "cpu", workers=0) == dict(
        num_workers=0,
        persistent_workers=False,
        prefetch_factor=None,
        worker_init_fn=None,
        multiprocessing_context=None,
        pin_memory=False,
    )
    data = build_data(
        TrainConfig(pipeline="cpu", train_samples=16, test_samples=8, batch_size=4), "cpu"
    )
    assert (
        data.train_loader.num_workers == 8 and "8 workers per process: 64 cores" in data.describe()
    )


def test_the_workers_crop_flip_and_normalise_as_the_device_pipeline():
    """The cpu pipeline's own ways (slice copies per sample into the run's memory format; in-place
    normalisation, channels_last as NHWC rows) give the device pipeline's batched gather and
    Normalize: equal crops, floats within 1e-6, in the memory format asked for whatever the
    batch's."""
    from accel_train.data.augment import Normalize, crop_flip_each
    from accel_train.data.pipeline import Finish, _batch_zeros

    normalize = Normalize("cpu", (0.4, 0.5, 0.6), (0.2, 0.25, 0.3))
    for pad, size in ((4, 32), (2, 16), (28, 224)):
        images = torch.randint(0, 256, (16, 3, size, size), dtype=torch.uint8)
        params = crop_flip_params(torch.arange(16), epoch=3, seed=7, pad=pad)
        want = crop_flip(images, *params, pad=pad)
        assert params[2].sum() > 0 and torch.equal(crop_flip_each(images, *params, pad=pad), want)
        for memory_format in (torch.channels_last, torch.contiguous_format):
            out = crop_flip_each(
                images, *params, pad=pad, out=_batch_zeros(images.shape, memory_format)
            )
            assert out.is_contiguous(memory_format=memory_format) and torch.equal(out, want)
            for batch in (want, out):
                x = Finish(normalize, memory_format)(batch)
                assert x.is_contiguous(memory_format=memory_format) and x.dtype == torch.float32
                assert torch.allclose(x, normalize(want), atol=1e-6)
