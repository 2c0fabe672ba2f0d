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
