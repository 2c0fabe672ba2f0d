"""Your own Datasets given to train() (data/given.py): the normalisation they apply is recorded as
what it is (a torchvision ImageFolder with Normalize(0.5, 0.5) recorded as mean 0 / std 1 would
make evaluate score 86.67% what train() scored 100%), or as unknown, and then
evaluate/predict of image files ask for --mean/--std; the data kind recorded is "dataset" (evaluate
without --data does not name the Dataset's class as an invalid --data choice).
"""

import json
import logging
import shutil

import numpy as np
import pytest
import torch
from conftest import run_cli
from safetensors.torch import load_file
from test_own_model import in_process_train
from tests_pkg.netmod import Net
from torch.utils.data import Dataset, Subset
from torchvision import datasets
from torchvision.transforms import Compose, Lambda, Normalize, Resize, ToTensor, v2

from accel_train import TrainConfig
from accel_train.data.given import seen_normalisation


class Plain(Dataset):
    def __init__(self, transform=None):
        self.transform = transform

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.zeros(3, 8, 8), 0


def test_the_normalisation_is_read_from_the_datasets_transform():
    half = Compose([Resize(16), ToTensor(), Normalize([0.5] * 3, [0.25] * 3)])
    assert seen_normalisation(Plain(half))[:2] == ((0.5,) * 3, (0.25,) * 3)
    # (wrapped)
    assert seen_normalisation(Subset(Plain(half), [0, 1]))[:2] == (
        (0.5,) * 3,
        (0.25,) * 3,
    )
    scaled = v2.Compose([v2.ToImage(), v2.ToDtype(torch.float32, scale=True)])
    assert seen_normalisation(Plain(scaled))[:2] == ((0.0,) * 3, (1.0,) * 3)
    assert (
        seen_normalisation(Plain(v2.Compose([v2.ToImage(), v2.Normalize([0.1] * 3, [0.2] * 3)])))[0]
        == (0.1,) * 3
    )
    # what cannot be seen is unknown, not a guess: no transform, a Lambda, a conversion without
    # scaling
    assert seen_normalisation(Plain()) is None
    assert seen_normalisation(Plain(Compose([ToTensor(), Lambda(lambda x: x * 2 - 1)]))) is None
    assert seen_normalisation(Plain(v2.Compose([v2.ToImage(), v2.ToDtype(torch.float32)]))) is None


def write_folder(root, per_class: int = 8):
    """train/ and val/ of two colour classes, 16x16 PNGs (lossless: the files decode to the
    Dataset's pixels)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c, name in enumerate(("blue", "red")):
            (root / split / name).mkdir(parents=True)
            for i in range(per_class):
                pixels = rng.integers(0, 120, (16, 16, 3))
                pixels[..., 2 - 2 * c] += 120  # blue or red
                Image.fromarray(pixels.astype(np.uint8)).save(root / split / name / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_folder(tmp_path_factory.mktemp("photos"))


def test_an_imagefolder_with_normalize_is_evaluated_and_predicted_as_it_trained(folder, tmp_path):
    transform = Compose([ToTensor(), Normalize([0.5] * 3, [0.5] * 3)])
    train_set, val_set = (
        datasets.ImageFolder(folder / split, transform) for split in ("train", "val")
    )
    out = tmp_path / "out"
    result = in_process_train(
        TrainConfig(epochs=3, batch_size=4, output_dir=str(out), lr=0.05),
        model=Net,
        train_set=train_set,
        test_set=val_set,
    )
    meta = json.loads((out / "model_config.json").read_text())
    assert (meta["mean"], meta["std"]) == ([0.5] * 3, [0.5] * 3), meta
    assert (meta["data"], meta["dataset"]) == ("dataset", "ImageFolder")
    # evaluate without --data: one line naming what to pass (was: "--data 'ImageFolder': invalid
    # choice")
    proc = run_cli(["evaluate", "--checkpoint", out, "--trust_model_code"])
    assert (
        proc.returncode == 2
        and proc.stderr.strip().splitlines()[-1]
        == "accel-train: error: the model was trained on your own Dataset (ImageFolder) through"
        " train(); pass --data imagefolder or cifar10 with --data_dir for files to evaluate it"
        " on (read as accel_train reads them: shorter side resized, centre crop, the recorded"
        " mean/std)"
    ), proc.stderr[-2000:]
    proc = run_cli(
        [
            "evaluate",
            "--checkpoint",
            out,
            "--trust_model_code",
            "--data",
            "imagefolder",
            "--data_dir",
            folder,
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"test accuracy {result['final_test_acc']:.2%} on 16 samples" in proc.stdout, (
        result,
        proc.stdout,
    )
    # predict: the probabilities the model gives the Dataset's own tensors
    model = Net(2)
    model.load_state_dict(load_file(out / "model.safetensors"))
    with torch.no_grad():
        expected = model.eval()(torch.stack([x for x, _ in val_set])).softmax(1).max(1).values
    proc = run_cli(
        ["predict", "--checkpoint", out, "--trust_model_code", "--format", "json", folder / "val"]
    )
    got = [json.loads(line)["top"][0]["probability"] for line in proc.stdout.splitlines()]
    assert got == pytest.approx(expected.tolist(), abs=1e-5), proc.stderr[-2000:]

    # unknown normalisation (null recorded, as a Dataset without a visible transform records it):
    # predict of files asks for --mean/--std, one line, and takes them
    unknown = shutil.copytree(out, tmp_path / "unknown")
    meta.update(mean=None, std=None)
    (unknown / "model_config.json").write_text(json.dumps(meta))
    image = folder / "val" / "red" / "0.png"
    proc = run_cli(["predict", "--checkpoint", unknown, "--trust_model_code", image])
    assert (
        proc.returncode == 2
        and proc.stderr.strip().splitlines()[-1]
        == "accel-train: error: the model was trained on your own Dataset (ImageFolder) whose"
        " normalisation was not recorded; pass --mean R,G,B --std R,G,B (what its transform"
        " applied to [0, 1] images)"
    ), proc.stderr[-2000:]
    proc = run_cli(
        [
            "predict",
            "--checkpoint",
            unknown,
            "--trust_model_code",
            "--format",
            "json",
            "--mean",
            "0.5,0.5,0.5",
            "--std",
            "0.5,0.5,0.5",
            image,
        ]
    )
    assert json.loads(proc.stdout)["top"][0]["probability"] == pytest.approx(got[8], abs=1e-5), (
        proc.stderr[-2000:]
    )


def test_a_dataset_whose_normalisation_is_not_seen_records_it_as_unknown(folder, tmp_path, caplog):
    class Tensors(Dataset):  # the user's own: no transform attribute to read
        def __init__(self, split):
            self.inner = datasets.ImageFolder(folder / split, ToTensor())
            self.classes = self.inner.classes

        def __len__(self):
            return len(self.inner)

        def __getitem__(self, i):
            return self.inner[i]

    out = tmp_path / "out"
    caplog.set_level(logging.INFO)
    in_process_train(
        TrainConfig(epochs=1, batch_size=4, output_dir=str(out)),
        model=Net,
        train_set=Tensors("train"),
        test_set=Tensors("val"),
    )
    meta = json.loads((out / "model_config.json").read_text())
    assert (meta["mean"], meta["std"], meta["dataset"]) == (None, None, "Tensors")
    said = [r.getMessage() for r in caplog.records]
    assert any("mean/std not seen in your Dataset" in m for m in said), said
