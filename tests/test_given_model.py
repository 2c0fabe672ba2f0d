"""A model given to train() as an object: recorded in model_config.json (and
config.yaml) only under an import path that rebuilds it (same state-dict keys and shapes, the same
logits for the same weights); else no architecture is recorded, one line says so, and evaluate /
predict ask for the model."""

import functools
import json

import pytest
import torch
import yaml
from conftest import run_cli
from test_own_model import in_process_train
from tests_pkg.netmod import Net, build

from accel_train import TrainConfig
from accel_train.model.create import create_model
from accel_train.model.own_model import name_of


def problem(given):
    """What setup says of `given` (a module, or a factory called with num_classes=4) recorded under
    user.name_of."""
    from accel_train.model.own_model import rebuild_problem

    model = given if isinstance(given, torch.nn.Module) else given(num_classes=4)
    rebuild = functools.partial(create_model, name_of(given), "imagenet", 4, 16)
    return rebuild_problem(model, rebuild, torch.randn(2, 3, 16, 16))


def test_only_an_import_path_that_rebuilds_the_model_passes():
    def local(num_classes):
        return Net(num_classes)

    # (a factory: called with num_classes, as recorded)
    assert problem(Net(4)) is None and problem(build) is None
    assert (
        "its features.0.weight has shape (8, 3, 3, 3), the trained model's (16, 3, 3, 3)"
        in problem(Net(4, 16))
    )
    # the shapes alike
    assert "it gives other logits for the same weights" in problem(Net(4, 8, "tanh"))
    assert "functools:partial" in problem(functools.partial(build, width=8))
    assert "local" in problem(local)
    model = Net(4, 8, "tanh")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    problem(model)  # (the model's own weights are restored after the check)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def small(out):
    return TrainConfig(
        data="random",
        train_samples=32,
        test_samples=16,
        batch_size=16,
        image_size=16,
        epochs=1,
        output_dir=str(out),
    )


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    from PIL import Image

    path = tmp_path_factory.mktemp("img") / "a.png"
    Image.new("RGB", (16, 16), (200, 30, 90)).save(path)
    return path


def test_a_module_its_path_does_not_rebuild_is_recorded_as_no_architecture(tmp_path, image, caplog):
    # Net(2, 8, "tanh") (here 10 classes) is not recorded as tests_pkg.netmod:Net: predict would
    # rebuild it with ReLU and predict other logits
    out = tmp_path / "out"
    in_process_train(small(out), model=Net(10, 8, "tanh"))
    meta = json.loads((out / "model_config.json").read_text())
    assert (
        meta["architecture"] is None
        and yaml.safe_load((out / "config.yaml").read_text())["model"] is None
    )
    step = json.loads(next((out / "checkpoints").glob("step_*/model_config.json")).read_text())
    assert step["architecture"] is None  # (evaluate and predict take a checkpoint folder too)
    said = [r.getMessage() for r in caplog.records if "records no architecture" in r.getMessage()]
    assert len(said) == 1 and "tests_pkg.netmod:Net" in said[0] and "other logits" in said[0], said
    for command in (["predict", "--checkpoint", out, image], ["evaluate", "--checkpoint", out]):
        proc = run_cli(command)
        assert (
            proc.returncode == 2
            and proc.stderr.strip().splitlines()[-1]
            == f"accel-train: error: {out}/model_config.json records no architecture (the model was"
            " given to train() and its import path does not rebuild it); pass --model"
            " module.path:callable that builds it, called with num_classes and {}"
        ), proc.stderr[-3000:]
    proc = run_cli(
        [
            "predict",
            "--checkpoint",
            out,
            "--format",
            "json",
            "--model",
            "tests_pkg.netmod:tanh_net",
            image,
        ]
    )
    assert proc.returncode == 0 and len(json.loads(proc.stdout)["top"]) == 5, proc.stderr[-3000:]


def test_a_module_its_path_rebuilds_is_recorded(tmp_path, image):
    out = tmp_path / "out"
    in_process_train(small(out), model=Net(10))
    meta = json.loads((out / "model_config.json").read_text())
    assert (meta["architecture"], meta["model_kwargs"]) == ("tests_pkg.netmod:Net", {})
    proc = run_cli(
        ["predict", "--checkpoint", out, "--format", "json", "--trust_model_code", image]
    )
    assert proc.returncode == 0 and len(json.loads(proc.stdout)["top"]) == 5, proc.stderr[-3000:]
