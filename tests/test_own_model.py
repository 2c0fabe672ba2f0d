"""Your own model and data (issue 24): --model module.path:callable, the trust rule for an import path read from a
file, every bad model or data set as one line (exit 2) with the output dir untouched, and train() from Python."""

import json

import pytest
import torch
from torch.utils.data import Dataset

from accel_train.errors import ConfigError
from conftest import ROOT, clean_env, run_cli
from test_bad_input import existing_run, snapshot  # noqa: F401 (a fixture)

TESTS = ROOT / "tests"
SMALL = ["--train_samples", "64", "--test_samples", "16", "--epochs", "1", "--batch_size", "16"]

CASES = {  # name: (--model and its flags, what the one line says)
    "no_module": (["--model", "tests_pkg.nope:build"], "no module named 'tests_pkg.nope' (searched the working directory"),
    "no_attribute": (["--model", "tests_pkg.mod:buidl"], "has no 'buidl'; it has Net, build"),
    "not_callable": (["--model", "tests_pkg.mod:NOT_CALLABLE"], "NOT_CALLABLE is a int, not a callable"),
    "raises": (["--model", "tests_pkg.mod:build", "--model_kwargs", '{"fail": true}'],
               "build(num_classes=10, fail=True) raised RuntimeError: the weights server is down; check --model_kwargs"),
    "not_a_module": (["--model", "tests_pkg.mod:not_a_module"], "returned a str, not a torch nn.Module"),
    "no_parameters": (["--model", "tests_pkg.mod:no_parameters"], "the Identity it returned has no parameters"),
    "wrong_shape": (["--model", "tests_pkg.mod:build", "--model_kwargs", '{"out": "wrong_shape"}'],
                    "its forward gives shape (2, 3) for a batch of shape (2, 3, 32, 32); it must give logits (2, 10)"),
    "tuple": (["--model", "tests_pkg.mod:build", "--model_kwargs", '{"out": "tuple"}'],
              "its forward returns a tuple; it must return one tensor of logits (2, 10)"),
    "dict": (["--model", "tests_pkg.mod:build", "--model_kwargs", '{"out": "dict"}'], "its forward returns a dict"),
    "stem_cifar": (["--model", "tests_pkg.mod:build", "--stem", "cifar"], "--stem cifar needs a ResNet-style model"),
    "init_from_code": (["--init_from", "MODEL_DIR"], "names the model code tests_pkg.mod:build: importing it runs"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_model_is_one_line_and_touches_nothing(case, tmp_path, existing_run):  # noqa: F811
    args, fragment = CASES[case]
    if case == "init_from_code":  # weights whose model_config.json names code: not imported without being allowed
        (tmp_path / "w").mkdir()
        (tmp_path / "w" / "model_config.json").write_text(json.dumps({"architecture": "tests_pkg.mod:build"}))
        args = ["--init_from", tmp_path / "w"]
    before = snapshot(existing_run)
    proc = run_cli([*SMALL, *args, "--output_dir", existing_run], env=clean_env(PYTHONPATH=str(TESTS)))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("accel-train: error: ") and fragment in errors[0], proc.stderr
    assert snapshot(existing_run) == before


class Items(Dataset):
    """A Dataset whose item is `item` (a bad one), 32 of them."""

    def __init__(self, item):
        self.item = item

    def __len__(self):
        return 32

    def __getitem__(self, i):
        return self.item


def in_process_train(*args, **kwargs):
    """accel_train.train() here, as a script would call it; Accelerate's state and the signal handlers restored."""
    import signal

    from accelerate.state import AcceleratorState, GradientState

    from accel_train import train
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        return train(*args, **kwargs)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


@pytest.mark.parametrize("item,said", [
    ((torch.zeros(3, 8, 8), 1.5), "train_set[0] is (a torch.float32 tensor of shape (3, 8, 8), a float); each item"),
    (torch.zeros(3, 8, 8), "train_set[0] is a torch.float32 tensor of shape (3, 8, 8); each item must be (image"),
    ((torch.zeros(8, 8, dtype=torch.uint8), 1), "(a torch.uint8 tensor of shape (8, 8), a int)")])
def test_a_data_set_item_that_is_not_an_image_and_a_label_is_one_line(item, said, tmp_path, existing_run):  # noqa: F811
    from accel_train import TrainConfig
    before = snapshot(existing_run)
    good = Items((torch.zeros(3, 8, 8), 1))
    with pytest.raises(ConfigError) as e:
        in_process_train(TrainConfig(output_dir=str(existing_run), epochs=1), model="tests_pkg.mod:build",
                         train_set=Items(item), test_set=good)
    assert said in str(e.value) and "\n" not in str(e.value)
    assert snapshot(existing_run) == before


def test_the_precision_check_of_your_model_is_remembered_for_its_code(tmp_path, monkeypatch):
    # gradcheck runs on your module as on timm's; its cached verdict belongs to the model file's contents (a changed
    # model is checked again), not only to the name --model gives it
    import importlib
    import shutil
    import sys

    from accel_train.config import TrainConfig
    from accel_train.gradcheck import cache_key, check
    from accel_train.hardware import DeviceFacts
    shutil.copytree(TESTS / "tests_pkg", tmp_path / "user_pkg")
    monkeypatch.syspath_prepend(str(tmp_path))
    model = importlib.import_module("user_pkg.mod").build(10)
    x, y = torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 3])
    assert check(model, x, y, torch.nn.CrossEntropyLoss(), "bf16").limit > 0
    cfg, facts = TrainConfig(model="user_pkg.mod:build"), DeviceFacts("cpu", "cpu")
    before = cache_key(cfg, 10, x.shape, "bf16", facts)
    (tmp_path / "user_pkg" / "mod.py").write_text((tmp_path / "user_pkg" / "mod.py").read_text() + "\n# changed\n")
    assert cache_key(cfg, 10, x.shape, "bf16", facts)["code"] != before["code"] is not None
    assert cache_key(TrainConfig(), 10, x.shape, "bf16", facts)["code"] is None  # a timm name
    sys.modules.pop("user_pkg.mod")
    sys.modules.pop("user_pkg")
