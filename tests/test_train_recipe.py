"""RandomResizedCrop for image folders (timm's parameters, the same math in every pipeline, a
function of (seed, epoch, sample index)), evaluation at --crop_pct, timm's per-sample transforms
(--color_jitter, --aa, --reprob) in the workers, the pipeline choice they force, and resume's
refusal of a change. The pure functions in process; one test of real launches for all the flags at
once (2 ranks, cpu pipeline vs 1 rank, cache pipeline; 2 ranks vs 1 rank on the device pipeline)."""

import json
import math
import random

import numpy as np
import pytest
import torch
from conftest import TINY_GN, launch
from PIL import Image
from test_imagefolder import write_image_folder

from accel_train.checkpoint.resume import keep_run_math
from accel_train.config.train_config import TrainConfig
from accel_train.data import build_data
from accel_train.data.crops import resized_crop, rrc_bicubic, rrc_boxes, store_size
from accel_train.data.images import Decode, decode_image
from accel_train.errors import ConfigError

PER_SAMPLE = dict(aa="rand-m9-mstd0.5", reprob=0.5, color_jitter=0.4)


def test_crops_are_drawn_as_timm_draws_them():
    from timm.data.transforms import RandomResizedCropAndInterpolation as Timm

    n = 20000
    for aspect in (1.0, 1.5, 0.4, 3.0):  # (3.0: most attempts fail, the fallback's share counts)
        boxes = rrc_boxes(torch.arange(n), 0, 1, torch.full((n,), aspect))
        assert (boxes[:, :2] >= 0).all() and (boxes[:, 2:] <= 1 + 1e-12).all()
        w, h = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
        img = Image.new("RGB", (int(600 * aspect), 600))
        random.seed(0)
        theirs = torch.tensor(
            [Timm.get_params(img, (0.08, 1.0), (3 / 4, 4 / 3)) for _ in range(n)],
            dtype=torch.float64,
        )
        their_area = theirs[:, 2] * theirs[:, 3] / (img.width * img.height)
        assert abs((w * h).mean() - their_area.mean()) < 0.01, aspect
        assert abs((w * h).std() - their_area.std()) < 0.01, aspect
        their_ratio = (theirs[:, 3] / theirs[:, 2]).log()
        assert abs((w * aspect / h).log().mean() - their_ratio.mean()) < 0.01, aspect
    narrow = rrc_boxes(torch.arange(100), 0, 1, torch.ones(100), scale=(0.25, 0.25), ratio=(1, 1))
    assert torch.allclose(narrow[:, 2] - narrow[:, 0], torch.full((100,), 0.5, dtype=torch.float64))
    # a function of (seed, epoch, index): the same for a sample wherever it sits in a batch; another
    # epoch, another crop
    a = rrc_boxes(torch.tensor([5, 9]), 3, 42, torch.ones(2))
    assert torch.equal(a[1], rrc_boxes(torch.tensor([9]), 3, 42, torch.ones(1))[0])
    assert not torch.equal(a, rrc_boxes(torch.tensor([5, 9]), 4, 42, torch.ones(2)))


def test_the_crop_resamples_the_box_and_mirrors():
    images = torch.randint(0, 256, (2, 3, 16, 16), dtype=torch.uint8)
    whole = torch.tensor([[0, 0, 1, 1]] * 2, dtype=torch.float32)
    assert torch.equal(
        resized_crop(images, whole, torch.tensor([0, 1]), 16),
        torch.stack([images[0], images[1].flip(-1)]),
    )
    quarter = resized_crop(images, torch.tensor([[0.5, 0, 1, 0.5]] * 2), torch.zeros(2), 8)
    assert torch.equal(quarter, images[:, :, :8, 8:])  # (whole pixels: no resampling)
    halved = resized_crop(images, whole, torch.zeros(2), 8)  # area-averaged: each 2x2 block's mean
    blocks = torch.nn.functional.avg_pool2d(images.float(), 2)
    assert (halved.float() - blocks).abs().max() <= 0.5
    bicubic = resized_crop(images, whole, torch.zeros(2), 8, "bicubic")
    assert (bicubic.float() - blocks).abs().float().mean() < 20 and bicubic.shape == (2, 3, 8, 8)
    assert not torch.equal(bicubic, halved)
    # --train_interpolation random (timm train.py's default): each sample bilinear or bicubic as its
    # bit says
    mixed = resized_crop(images, whole, torch.zeros(2), 8, "random", torch.tensor([0, 1]))
    assert torch.equal(mixed[0], halved[0]) and torch.equal(mixed[1], bicubic[1])
    bits = rrc_bicubic(torch.arange(1000), 0, 42)
    assert 0.45 < bits.float().mean() < 0.55 and not torch.equal(
        bits, rrc_bicubic(torch.arange(1000), 1, 42)
    )
    # (a function of the sample alone)
    assert torch.equal(bits[[7, 3]], rrc_bicubic(torch.tensor([7, 3]), 0, 42))


def test_the_bilinear_crop_reads_nothing_back_to_the_host(monkeypatch):
    """The device pipeline's default crop is one batched roi_align: no .cpu()/.tolist() of the
    batch's tensors (on an accelerator each is a sync: not even `bicubic.bool().cpu()`
    for an interpolation).
    """
    reads = []
    for name in ("cpu", "tolist", "item", "__bool__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor,
            name,
            lambda self, *a, _o=original, _n=name, **k: (reads.append(_n), _o(self, *a, **k))[1],
        )
    images = torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8)
    resized_crop(
        images,
        torch.tensor([[0.1, 0.2, 0.9, 0.8]] * 4),
        torch.zeros(4),
        8,
        "bilinear",
        torch.ones(4),
    )
    assert reads == []


def test_evaluation_resizes_to_image_size_over_crop_pct_as_timm_does(tmp_path):
    from timm.data import create_transform

    # smooth, so that the resize filters' small differences stay small
    y, x = np.mgrid[0:180, 0:300]
    smooth = np.stack(
        [x * 255 / 300, y * 255 / 180, 128 + 100 * np.sin(x / 20) * np.cos(y / 15)], -1
    )
    Image.fromarray(smooth.astype(np.uint8)).save(tmp_path / "a.png")
    ours = decode_image(tmp_path / "a.png", 64, 0.875).float()
    timm_eval = create_transform(
        64, crop_pct=0.875, interpolation="bilinear", mean=(0, 0, 0), std=(1, 1, 1)
    )
    theirs = timm_eval(Image.open(tmp_path / "a.png").convert("RGB")) * 255
    assert ours.shape == theirs.shape == (3, 64, 64) and (ours - theirs).abs().mean() < 2
    whole = decode_image(tmp_path / "a.png", Decode(store_size(64), whole=True))
    assert whole.shape == (3, 96, 96)  # the whole image, squashed: RandomResizedCrop's store
    # the default: timm's 0.875, or the weights' own where timm's pretrained weights are used
    # (--pretrained)
    from types import SimpleNamespace

    from accel_train.config.recipes import default_crop_pct

    assert default_crop_pct(TrainConfig(data="imagefolder")) == 0.875
    assert (
        default_crop_pct(SimpleNamespace(crop_pct=None, pretrained=True, model="resnet18.a1_in1k"))
        == 0.95
    )
    assert default_crop_pct(SimpleNamespace(crop_pct=0.8, pretrained=True, model="resnet18")) == 0.8
    # --init_from an image-folder run's export: its model_config.json's crop_pct (a CIFAR export's
    # 1.0 is not a photo's)
    (tmp_path / "run").mkdir()
    (tmp_path / "run/model.safetensors").write_bytes(b"")
    for data, want in (("imagefolder", 0.9), ("cifar10", 0.875)):
        (tmp_path / "run/model_config.json").write_text(
            json.dumps({"data": data, "crop_pct": 0.9 if want == 0.9 else 1.0})
        )
        cfg = SimpleNamespace(
            crop_pct=None, pretrained=False, model="resnet18", init_from=str(tmp_path / "run")
        )
        assert default_crop_pct(cfg) == want, data


# levels of 255: the most the pipelines' crops of one box may differ on average (crops.py's two
# kernels)
AGREE = 1.0


def crop_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean |a - b| of two uint8 batches, in levels of 255."""
    assert a.dtype == b.dtype == torch.uint8 and a.shape == b.shape
    return (a.float() - b.float()).abs().mean().item()


def test_the_workers_uint8_crop_agrees_with_the_device_pipelines_roi_align():
    """The workers resize each crop on uint8, the device pipeline all of a batch's with roi_align on
    floats: at 224 px from the 336 px store, on photo-like content (shading, texture, grain), boxes
    as training draws them, the two differ by less than AGREE on average (measured: 0.25 bilinear,
    0.19 bicubic, 0.22 random on photos; roi_align on the unrounded boxes was 1.57 away, which is
    why every pipeline resamples whole stored pixels).
    """
    from accel_train.data.crops import resized_crop_each

    n, size = 12, 224
    side = store_size(size)
    y, x = torch.meshgrid(
        torch.arange(side, dtype=torch.float32),
        torch.arange(side, dtype=torch.float32),
        indexing="ij",
    )
    g = torch.Generator().manual_seed(0)
    shades = torch.rand(n, 3, 1, 1, generator=g) * 0.6 + 0.4
    shading = (
        128
        + 90 * torch.sin(x / 37 + 1) * torch.cos(y / 53)
        + 40 * torch.sin(x / 3.1) * torch.sin(y / 2.7)
    )
    images = (
        (shading * shades + torch.randn(n, 3, side, side, generator=g) * 8).round().clamp(0, 255)
    )
    images = images.to(torch.uint8)
    idx = torch.arange(n)
    boxes = rrc_boxes(idx, 0, 7, torch.full((n,), 1.3)).float()
    flips = idx % 2
    for interpolation in ("bilinear", "bicubic", "random"):
        bicubic = rrc_bicubic(idx, 0, 7)
        device = resized_crop(images, boxes, flips, size, interpolation, bicubic)
        out = torch.zeros(n, 3, size, size, dtype=torch.uint8).contiguous(
            memory_format=torch.channels_last
        )
        workers = resized_crop_each(images, boxes, flips, out, interpolation, bicubic)
        assert workers is out and crop_difference(workers, device) < AGREE, interpolation


def test_the_workers_crop_stays_uint8_until_the_device(folder, monkeypatch):
    """The cpu and cache pipelines' workers make uint8 batches without turning an image (a uint8
    tensor) into floats or calling roi_align (the float resample cost ~10x the uint8 one there:
    crops.py); floats are made on the device (Finish). (The boxes' own float64 math is not an
    image's.)"""
    import torchvision.ops

    calls = []
    monkeypatch.setattr(torchvision.ops, "roi_align", lambda *a, **k: calls.append("roi_align"))

    def watched(name, original):
        def conversion(self, *args, **kwargs):
            dtype = (
                {
                    "float": torch.float32,
                    "double": torch.float64,
                    "half": torch.float16,
                    "bfloat16": torch.bfloat16,
                }.get(name)
                or kwargs.get("dtype")
                or next((a for a in args if isinstance(a, torch.dtype)), None)
            )
            if self.dtype == torch.uint8 and dtype is not None and dtype.is_floating_point:
                calls.append(f"{name}({dtype})")
            return original(self, *args, **kwargs)

        return conversion

    for name in ("float", "double", "half", "bfloat16", "to", "type"):
        monkeypatch.setattr(torch.Tensor, name, watched(name, getattr(torch.Tensor, name)))
    for pipeline in ("cpu", "cache"):
        for interpolation in ("bilinear", "random"):
            data = build_data(
                TrainConfig(
                    pipeline=pipeline,
                    train_interpolation=interpolation,
                    channels_last=True,
                    **folder,
                ),
                "cpu",
            )
            calls.clear()
            x, _ = data.train_loader.dataset.__getitems__(list(range(8)))
            assert calls == [] and x.dtype == torch.uint8 and x.shape == (8, 3, 16, 16), (
                pipeline,
                calls,
            )
            assert x.is_contiguous(memory_format=torch.channels_last)


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
    return dict(
        data="imagefolder",
        data_dir=str(write_image_folder(tmp_path / "d")),
        image_size=16,
        batch_size=4,
        mean="0.5,0.5,0.5",
        std="0.25,0.25,0.25",
        num_workers=0,
    )


def train_batch(data, indices, epoch):
    """The uint8 training images of `indices` in `epoch` as the pipeline's loader makes them."""
    ds = data.train_loader.dataset
    ds.set_epoch(epoch)
    batch = ds.__getitems__(indices)
    if data.pipeline != "device":
        return batch[0]
    x = data.inputs(batch, train=True, epoch=epoch)[0]
    return (x * torch.tensor([0.25] * 3).view(1, 3, 1, 1) * 255 + 127.5).round().to(torch.uint8)


def test_random_resized_crop_is_the_same_in_every_pipeline_and_moves_with_the_epoch(folder):
    pipelines = {
        p: build_data(TrainConfig(pipeline=p, **folder), "cpu") for p in ("device", "cpu", "cache")
    }
    for data in pipelines.values():
        assert data.train_loader.dataset.__len__() == 24
    assert (
        pipelines["device"].info.crop_pct == 0.875
        and "16px_crop0.875" in pipelines["cache"].describe()
    )
    # the whole images at 1.5x, a key of their own
    assert "24px_whole" in pipelines["cache"].describe()
    reference = train_batch(pipelines["device"], list(range(8)), epoch=2)
    workers = train_batch(pipelines["cpu"], list(range(8)), epoch=2)
    # (one kernel: equal)
    assert torch.equal(train_batch(pipelines["cache"], list(range(8)), epoch=2), workers)
    # (the two kernels: measured 0.30 on this noise)
    assert crop_difference(workers, reference) < AGREE
    # one rank of two (every other sample) sees the same images as the one rank does
    assert torch.equal(train_batch(pipelines["cpu"], [1, 3, 5, 7], epoch=2), workers[1::2])
    assert (
        train_batch(pipelines["cache"], list(range(8)), epoch=3) != workers
    ).float().mean() > 0.3
    # --train_interpolation random: the same in every pipeline too, and bicubic for some samples
    mixed = {
        p: build_data(TrainConfig(pipeline=p, train_interpolation="random", **folder), "cpu")
        for p in ("device", "cpu", "cache")
    }
    random_ref = train_batch(mixed["device"], list(range(8)), epoch=2)
    random_workers = train_batch(mixed["cpu"], list(range(8)), epoch=2)
    assert torch.equal(train_batch(mixed["cache"], list(range(8)), epoch=2), random_workers)
    assert crop_difference(random_workers, random_ref) < AGREE
    same = [torch.equal(a, b) for a, b in zip(random_ref, reference)]
    assert same == (rrc_bicubic(torch.arange(8), 2, 42) == 0).tolist() and not all(same), same
    # each sample its own crop
    assert len(set(map(tuple, rrc_boxes(torch.arange(64), 2, 42, torch.ones(64)).tolist()))) == 64
    # CIFAR-10 and random data keep the pad crop by default
    for pipeline in ("device", "cpu"):
        cfg = TrainConfig(
            data="random", train_samples=8, test_samples=4, batch_size=4, pipeline=pipeline
        )
        assert build_data(cfg, "cpu").train_loader.dataset.augment.crop == "pad"


def test_timm_per_sample_transforms_run_in_the_workers_alike_and_leave_the_device_pipeline(folder):
    auto = build_data(TrainConfig(**folder, **PER_SAMPLE), "cpu")
    assert (
        auto.pipeline == "cache"
        and "--color_jitter 0.4, --aa rand-m9-mstd0.5, --reprob 0.5: timm's per-sample transforms,"
        " which DataLoader workers run"
        in auto.describe()
    )
    cpu = build_data(TrainConfig(pipeline="cpu", **folder, **PER_SAMPLE), "cpu")
    plain = build_data(TrainConfig(pipeline="cpu", **folder), "cpu")
    state, torch_state = random.getstate(), torch.get_rng_state()
    a = train_batch(auto, list(range(8)), epoch=1)
    # (restored)
    assert random.getstate() == state and torch.equal(torch.get_rng_state(), torch_state)
    assert torch.equal(train_batch(cpu, [4, 5, 6, 7], epoch=1), a[4:])  # any batch, any pipeline
    # they do something
    assert (a != train_batch(plain, list(range(8)), epoch=1)).float().mean() > 0.3
    assert (a != train_batch(auto, list(range(8)), epoch=2)).float().mean() > 0.3
    random_data = dict(data="random", train_samples=8, test_samples=4, batch_size=4, num_workers=0)
    on_cpu = build_data(TrainConfig(aa="trivial", **random_data), "cpu")
    assert on_cpu.pipeline == "cpu" and "--aa trivial" in on_cpu.describe()
    with pytest.raises(
        ConfigError, match=r"--pipeline device cannot apply --reprob 0.5 .*use --pipeline cpu"
    ):
        TrainConfig(pipeline="device", reprob=0.5, **random_data)
    with pytest.raises(ConfigError, match="--aa 'bogus' is not an augmentation string timm parses"):
        TrainConfig(aa="bogus", **random_data)
    from accel_train.data import given_data

    with pytest.raises(ConfigError, match="--reprob 0.5: your Datasets are loaded as they are"):
        given_data(TrainConfig(pipeline="cpu", reprob=0.5, **random_data), None, "cpu")
    for bad, says in (
        (dict(scale="0.5"), "--scale must be two numbers"),
        (dict(ratio="2,1"), "--ratio must be"),
        (dict(crop_pct=0.9), "--crop_pct resizes image folders"),
        (dict(reprob=2), "--reprob"),
    ):
        with pytest.raises(ConfigError, match=says):
            TrainConfig(**{**random_data, **bad})


def test_a_resume_refuses_another_recipe():
    old = dict(
        aa="rand-m9-mstd0.5",
        reprob=0.25,
        color_jitter=0.0,
        train_crop="random_resized",
        scale="0.08,1",
        ratio="3/4,4/3",
        train_interpolation="bilinear",
    )
    cfg = TrainConfig(data="random", pipeline="cpu", aa="rand-m9-mstd0.5", reprob=0.25)
    assert keep_run_math(old, cfg)["train_crop"] == "random_resized"  # (auto: the checkpoint's)
    for flag, value in (
        ("aa", "rand-m7"),
        ("reprob", 0.5),
        ("scale", "0.2,1"),
        ("train_interpolation", "bicubic"),
    ):
        with pytest.raises(ConfigError, match=f"--{flag} .* differs from the checkpoint's"):
            keep_run_math(old, TrainConfig(data="random", pipeline="cpu", **{**old, flag: value}))


@pytest.mark.launches
def test_two_ranks_equal_one_rank_with_every_recipe_flag_in_every_pipeline(tmp_path):
    root = write_image_folder(tmp_path / "d", train=16, val=4)
    env = {"XDG_CACHE_HOME": str(tmp_path / "home")}
    # (fp32: the CPU configs leave bf16 to a CPU that has it, ~1e-3 apart)
    base = [
        *TINY_GN,
        "--data_dir",
        root,
        "--image_size",
        "24",
        "--epochs",
        "2",
        "--log_every",
        "1",
        "--scale",
        "0.2,1",
        "--ratio",
        "3/4,4/3",
        "--crop_pct",
        "0.9",
        "--mean",
        "0.5,0.5,0.5",
        "--std",
        "0.25,0.25,0.25",
        "--mixed_precision",
        "no",
    ]
    common = [
        *base,
        "--color_jitter",
        "0.3",
        "--aa",
        "rand-m9-mstd0.5",
        "--reprob",
        "0.5",
        "--train_interpolation",
        "random",
    ]
    # (loaded: 300 s ran out)
    launch(
        "2proc_cpu.yaml",
        [
            *common,
            "--batch_size",
            "8",
            "--pipeline",
            "cpu",
            "--num_workers",
            "1",
            "--output_dir",
            tmp_path / "two",
        ],
        env=env,
        timeout=600,
    )
    launch(
        "cpu.yaml",
        [*common, "--batch_size", "16", "--pipeline", "auto", "--output_dir", tmp_path / "one"],
        env=env,
    )
    steps = {
        k: [json.loads(x) for x in (tmp_path / k / "steps.jsonl").read_text().splitlines()]
        for k in ("one", "two")
    }
    assert len(steps["one"]) == len(steps["two"]) == 6  # 48 images, global batch 16, 2 epochs
    for a, b in zip(steps["one"], steps["two"]):
        assert abs(a["loss"] - b["loss"]) < 1e-5, (a, b)
    config = (tmp_path / "one/config.yaml").read_text()
    assert (
        "pipeline: cache" in config
        and "train_crop: random_resized" in config
        and "crop_pct: 0.9" in config
    )
    assert json.loads((tmp_path / "one/model_config.json").read_text())["crop_pct"] == 0.9
    # and the recipe matters: the same run without the per-sample transforms has other losses.
    # Without them the device pipeline crops, batched, on the device: 2 ranks there equal 1 rank too
    launch(
        "cpu.yaml",
        [*base, "--batch_size", "16", "--max_steps", "3", "--output_dir", tmp_path / "plain"],
        env=env,
    )
    launch(
        "2proc_cpu.yaml",
        [
            *base,
            "--batch_size",
            "8",
            "--max_steps",
            "3",
            "--pipeline",
            "device",
            "--output_dir",
            tmp_path / "plain2",
        ],
        env=env,
    )
    plain, plain2 = (
        [json.loads(x) for x in (tmp_path / k / "steps.jsonl").read_text().splitlines()]
        for k in ("plain", "plain2")
    )
    assert abs(plain[1]["loss"] - steps["one"][1]["loss"]) > 1e-4 and len(plain) == len(plain2) == 3
    assert "pipeline: device" in (tmp_path / "plain/config.yaml").read_text()
    for a, b in zip(plain, plain2):
        assert abs(a["loss"] - b["loss"]) < 1e-5, (a, b)
    assert math.isfinite(steps["one"][-1]["loss"])
