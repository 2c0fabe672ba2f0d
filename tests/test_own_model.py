"""Your own model and data: --model module.path:callable, the trust rule for an import
path read from a file, every bad model or data set as one line (exit 2) with the output dir
untouched, and train() from Python.
"""

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
import tests_pkg.mod
import torch
import yaml
from conftest import (
    CONFIGS,
    ROOT,
    clean_env,
    launch,
    run,
    run_cli,
    steps_logged,
    trainer_pids,
    wait_for,
    write_cifar,
)
from safetensors.torch import load_file
from test_bad_input import (
    existing_run,  # noqa: F401 (a fixture)
    snapshot,
)
from test_resume import worst
from torch.utils.data import Dataset

from accel_train.errors import ConfigError, Diverged, Preempted

TESTS = ROOT / "tests"
SMALL = ["--train_samples", "64", "--test_samples", "16", "--epochs", "1", "--batch_size", "16"]

CASES = {  # name: (--model and its flags, what the one line says)
    "no_module": (
        ["--model", "tests_pkg.nope:build"],
        "no module named 'tests_pkg.nope' (searched the working directory and PYTHONPATH: ",
    ),
    "no_attribute": (["--model", "tests_pkg.mod:buidl"], "has no 'buidl'; it has Net, build"),
    "not_callable": (
        ["--model", "tests_pkg.mod:NOT_CALLABLE"],
        "NOT_CALLABLE is a int, not a callable",
    ),
    "raises": (
        ["--model", "tests_pkg.mod:build", "--model_kwargs", '{"fail": true}'],
        (
            "build(num_classes=10, fail=True) raised RuntimeError: the weights server is down;"
            " check --model_kwargs"
        ),
    ),
    "not_a_module": (
        ["--model", "tests_pkg.mod:not_a_module"],
        "returned a str, not a torch nn.Module",
    ),
    "no_parameters": (
        ["--model", "tests_pkg.mod:no_parameters"],
        "the Identity it returned has no parameters",
    ),
    "wrong_shape": (
        ["--model", "tests_pkg.mod:build", "--model_kwargs", '{"out": "wrong_shape"}'],
        (
            "its forward gives shape (2, 3) for a batch of shape (2, 3, 32, 32); it must give"
            " logits (2, 10)"
        ),
    ),
    "tuple": (
        ["--model", "tests_pkg.mod:build", "--model_kwargs", '{"out": "tuple"}'],
        "its forward returns a tuple; it must return one tensor of logits (2, 10)",
    ),
    "dict": (
        ["--model", "tests_pkg.mod:build", "--model_kwargs", '{"out": "dict"}'],
        "its forward returns a dict",
    ),
    "tuple_in_training": (
        ["--model", "tests_pkg.mod:build", "--model_kwargs", '{"out": "tuple_in_training"}'],
        "its forward returns a tuple in training mode; it must return one tensor of logits (2, 10)",
    ),
    "stem_cifar": (
        ["--model", "tests_pkg.mod:build", "--stem", "cifar"],
        "--stem cifar needs a ResNet-style model",
    ),
    "init_from_code": (
        ["--init_from", "MODEL_DIR"],
        "names the model code tests_pkg.mod:build: importing it runs",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_model_is_one_line_and_touches_nothing(case, tmp_path, existing_run):
    args, fragment = CASES[case]
    if case == "init_from_code":
        # weights whose model_config.json names code: not imported without being allowed
        (tmp_path / "w").mkdir()
        (tmp_path / "w" / "model_config.json").write_text(
            json.dumps({"architecture": "tests_pkg.mod:build"})
        )
        args = ["--init_from", tmp_path / "w"]
    before = snapshot(existing_run)
    proc = run_cli(
        [*SMALL, *args, "--output_dir", existing_run], env=clean_env(PYTHONPATH=str(TESTS))
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert (
        len(errors) == 1 and errors[0].startswith("accel-train: error: ") and fragment in errors[0]
    ), proc.stderr
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
    """accel_train.train() here, as a script would call it; Accelerate's state reset. The signal
    handlers are the script's again afterwards, whether it returned or raised: train() gives them
    back (the script goes on).
    """
    import signal

    from accelerate.state import AcceleratorState, GradientState

    from accel_train import train

    handlers = {
        sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
    }
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        return train(*args, **kwargs)
    finally:
        left = {sig: signal.getsignal(sig) for sig in handlers}
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        assert left == handlers, (
            "train() left its stop handlers installed: the script's Ctrl-C is swallowed"
        )


@pytest.mark.parametrize(
    "item,said",
    [
        (
            (torch.zeros(3, 8, 8), 1.5),
            "train_set[0] is (a torch.float32 tensor of shape (3, 8, 8), a float); each item",
        ),
        (
            torch.zeros(3, 8, 8),
            "train_set[0] is a torch.float32 tensor of shape (3, 8, 8); each item must be (image",
        ),
        (
            (torch.zeros(8, 8, dtype=torch.uint8), 1),
            "(a torch.uint8 tensor of shape (8, 8), a int)",
        ),
        (
            (torch.zeros(3, 8, 8), 7),
            "train_set has label 7, but there are 2 classes (a, b): labels are 0..1",
        ),
    ],
)
def test_a_data_set_item_that_is_not_an_image_and_a_label_is_one_line(
    item, said, tmp_path, existing_run
):
    from accel_train import TrainConfig

    before = snapshot(existing_run)
    good = Items((torch.zeros(3, 8, 8), 1))
    with pytest.raises(ConfigError) as e:
        # (the label 7: outside the classes; the loss raised at the first step)
        in_process_train(
            TrainConfig(output_dir=str(existing_run), epochs=1),
            model="tests_pkg.mod:build",
            train_set=Items(item),
            test_set=good,
            classes=["a", "b"],
        )
    assert said in str(e.value) and "\n" not in str(e.value)
    assert snapshot(existing_run) == before


def test_train_leaves_the_callers_config_as_it_was_built(tmp_path):
    # an image folder and every automatic setting left unset: the run resolves the image size,
    # batch, stem, mean/std, pipeline, crops, workers, precision and memory format for itself
    import dataclasses

    from test_imagefolder import write_image_folder

    from accel_train import TrainConfig

    data = write_image_folder(tmp_path / "d", train=4, val=2)
    cfg = TrainConfig(data_dir=str(data), model="test_resnet", epochs=1, output_dir=str(tmp_path))
    built = dataclasses.asdict(cfg), dict(vars(cfg))
    result = in_process_train(cfg)
    assert (dataclasses.asdict(cfg), dict(vars(cfg))) == built
    # what the run resolved is its own: config.yaml records values the caller left unset
    recorded = yaml.safe_load((tmp_path / "config.yaml").read_text())
    unset = [k for k in ("image_size", "batch_size", "mean", "num_workers") if built[0][k] is None]
    assert unset and all(recorded[k] is not None for k in unset), recorded
    # ... beside what was asked of each (format 2: config/resolved.py)
    assert recorded["format"] == 2 and {
        k: recorded["asked"][k] for k in ("image_size", "batch_size", "mean", "mixed_precision")
    } == {"image_size": None, "batch_size": None, "mean": None, "mixed_precision": "auto"}
    assert recorded["mixed_precision"] in ("no", "bf16", "fp16")  # the run's, at its end
    assert result["output_dir"] == str(tmp_path)


def test_numpy_and_narrow_integer_labels_are_labels():
    # a numpy integer label (numpy arrays of labels) was refused as "a int64"; an int32 label passed
    # the check and then stopped the first step with a traceback (cross_entropy takes int64 class
    # indices)
    import numpy as np
    from torch.utils.data import default_collate

    from accel_train.data.given import check_item, check_labels, cpu_inputs

    for label in (np.int64(1), np.int32(1), torch.tensor(1, dtype=torch.int32)):
        check_item(Items((torch.zeros(3, 8, 8), label)), "train_set")
    batch = default_collate([(torch.zeros(3, 8, 8), np.int32(i)) for i in range(2)])
    x, y = cpu_inputs(torch.contiguous_format)(batch, train=True)
    torch.nn.functional.cross_entropy(torch.zeros(2, 2), y)  # (raised on int32)
    assert y.tolist() == [0, 1]
    named = Items((torch.zeros(3, 8, 8), 1))
    # targets that are class names: the range check reads the first item's label
    named.targets = [
        "cat",
        "dog",
    ]
    check_labels(named, "train_set", ("cat", "dog"))


def test_the_precision_check_of_your_model_is_remembered_for_its_code(tmp_path, monkeypatch):
    # gradcheck runs on your module as on timm's; its cached verdict belongs to the model file's
    # contents (a changed model is checked again) and to the model's modules and shapes (models
    # recorded under one name: a notebook's __main__:Net has no file, a functools.partial is
    # recorded as functools:partial), not only to --model's name
    import functools
    import importlib
    import shutil
    import sys

    from accel_train.config.train_config import TrainConfig
    from accel_train.model.own_model import name_of
    from accel_train.platform.hardware import DeviceFacts
    from accel_train.precision.cache import cache_key
    from accel_train.precision.check import check

    shutil.copytree(TESTS / "tests_pkg", tmp_path / "user_pkg")
    monkeypatch.syspath_prepend(str(tmp_path))
    model = importlib.import_module("user_pkg.mod").build(10)
    x, y = torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 3])
    verdict = check(model, x, y, torch.nn.CrossEntropyLoss(), "bf16")
    assert verdict.ok and verdict.worst[1] > 0  # (bf16 computed, and its gradients passed)
    cfg, facts = TrainConfig(model="user_pkg.mod:build"), DeviceFacts("cpu", "cpu")
    before = cache_key(cfg, 10, x.shape, "bf16", facts, model)
    (tmp_path / "user_pkg" / "mod.py").write_text(
        (tmp_path / "user_pkg" / "mod.py").read_text() + "\n# changed\n"
    )
    assert cache_key(cfg, 10, x.shape, "bf16", facts, model)["code"] != before["code"] is not None
    narrow, wide = (functools.partial(tests_pkg.mod.Net, width=w) for w in (4, 64))
    assert name_of(narrow) == name_of(wide)  # (what config.yaml records for both)
    keys = [
        cache_key(TrainConfig(model=name_of(f)), 10, x.shape, "bf16", facts, f(10))
        for f in (narrow, wide)
    ]
    assert keys[0] != keys[1]
    sys.modules.pop("user_pkg.mod")
    sys.modules.pop("user_pkg")


BLOCKS = """
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.conv = nn.Conv2d(width, width, 3, stride=2, padding=1)

    def forward(self, x):
        return self.conv(x){edit}
"""
NETC = """
import torch.nn as nn

from blocks34 import Block


def build(num_classes):
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), Block(4), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(4, num_classes))
"""


def test_a_cached_verdict_is_not_taken_after_an_edit_to_a_layer_in_a_second_local_module(
    tmp_path, monkeypatch
):
    # netc.py builds the model, blocks.py holds its Block; a key of netc.py and the modules' repr
    # and shapes alone would keep the earlier verdict "match fp32" after an edit to Block.forward
    # (e.g. the input its stride-2 convolution sees: the bad kernel's shape), and bf16 would train
    # on the wrong kernel. The code of every module the model uses is in the key; the
    # same code gives the same key (the cache still works)
    import importlib
    import sys

    from accel_train.config.train_config import TrainConfig
    from accel_train.platform.hardware import DeviceFacts
    from accel_train.precision.cache import cache_key

    monkeypatch.syspath_prepend(str(tmp_path))
    cfg, facts = TrainConfig(model="netc34:build"), DeviceFacts("cpu", "cpu")

    def key(edit):
        (tmp_path / "blocks34.py").write_text(BLOCKS.format(edit=edit))
        (tmp_path / "netc34.py").write_text(NETC)
        for name in ("blocks34", "netc34"):
            sys.modules.pop(name, None)
        importlib.invalidate_caches()
        model = importlib.import_module("netc34").build(10)
        return cache_key(cfg, 10, (4, 3, 8, 8), "bf16", facts, model)

    try:
        before, same, edited = key(""), key(""), key("[:, :, :1, :1]")
    finally:
        for name in ("blocks34", "netc34"):
            sys.modules.pop(name, None)
    # (the modules' repr and shapes: alike)
    assert before == same and edited["structure"] == before["structure"]
    assert edited["code"] != before["code"]


def python_path(*extra) -> str:
    return os.pathsep.join([*map(str, extra), os.environ.get("PYTHONPATH", "")])


def write_test_images(data, folder):
    """The test split of a CIFAR-10 tree as PNG files, and their labels."""
    from PIL import Image

    from accel_train.data import read_cifar10

    images, labels = read_cifar10(data, ("test",))["test"]
    folder.mkdir()
    for i, image in enumerate(images):
        Image.fromarray(image.permute(1, 2, 0).numpy()).save(folder / f"{i:03d}.png")
    return labels.tolist()


@pytest.mark.launches
def test_your_model_resumes_exactly_on_two_ranks_and_on_one_and_its_export_is_evaluated(tmp_path):
    # --model tests_pkg.mod:build (GroupNorm, no dropout: comparable across process counts), 256
    # learnable CIFAR-10 samples, 2 ranks x 8 x --grad_accum 2: 8 steps an epoch, 2 epochs, with
    # --ema. The uninterrupted run, then the same run stopped by SIGTERM to both ranks and resumed
    # on 2 ranks (the same weights and EMA, 1e-6) and, from a copy of its checkpoint, on 1 rank
    # (1e-5: another reduction order).
    data = write_cifar(tmp_path / "in", rows=(52, 52, 52, 50, 50), test_rows=40, learnable=True)
    args = [
        "--model",
        "tests_pkg.mod:build",
        "--data",
        "cifar10",
        "--data_dir",
        data,
        "--epochs",
        "2",
        "--batch_size",
        "8",
        "--grad_accum",
        "2",
        "--ema",
        "--log_every",
        "1",
    ]
    env = clean_env(PYTHONPATH=python_path(TESTS))
    ref, out = tmp_path / "ref", tmp_path / "out"
    launch("2proc_cpu.yaml", [*args, "--output_dir", ref], env=env)
    tag = uuid.uuid4().hex
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        CONFIGS / "2proc_cpu.yaml",
        "-m",
        "accel_train",
        *args,
        "--output_dir",
        out,
    ]
    proc = subprocess.Popen(
        list(map(str, cmd)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env={**env, "ACCEL_TEST_TAG": tag, "TESTS_PKG_DELAY": "0.2"},
        start_new_session=True,
    )
    try:
        wait_for(lambda: steps_logged(out) >= 3, timeout=120)
        for pid in wait_for(
            lambda: len(trainer_pids(tag)) == 2 and trainer_pids(tag), timeout=30
        ).values():
            os.kill(pid, signal.SIGTERM)  # what a platform sends every process of the job
        text = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    step = int(re.findall(r"stopped by SIGTERM at step (\d+)", text)[0])
    assert 3 <= step < 16, text[-3000:]  # (before the end: there is a rest to resume)
    one = shutil.copytree(out, tmp_path / "one")
    resumed = launch("2proc_cpu.yaml", [*args, "--output_dir", out, "--resume", "auto"], env=env)
    assert f"step {step}, " in resumed.stderr, resumed.stderr[-3000:]
    a = load_file(ref / "model.safetensors")
    assert worst(a, load_file(out / "model.safetensors")) <= 1e-6
    assert (
        worst(load_file(ref / "model_ema.safetensors"), load_file(out / "model_ema.safetensors"))
        <= 1e-6
    )
    on_one = launch("cpu.yaml", [*args, "--output_dir", one, "--resume", "auto"], env=env)
    assert "2 -> 1 processes; per-process batch 8 -> 16" in on_one.stderr, on_one.stderr[-3000:]
    assert worst(a, load_file(one / "model.safetensors")) <= 1e-5
    # (the EMA is its own weights, not the model's)
    assert worst(a, load_file(ref / "model_ema.safetensors")) > 1e-4
    meta = json.loads((ref / "model_config.json").read_text())
    assert (meta["architecture"], meta["model_kwargs"]) == ("tests_pkg.mod:build", {})
    acc = [json.loads(r) for r in (ref / "metrics.jsonl").read_text().splitlines()][-1]["test_acc"]
    assert acc >= 0.2  # learnable data: the export is a trained model, not chance (0.1)

    # evaluate / predict of the export: nothing imported without --trust_model_code (the module
    # marks its import), one line naming the path; with it, the training's test accuracy
    marker, images = tmp_path / "imported", tmp_path / "images"
    labels = write_test_images(data, images)
    for command in (["evaluate", "--data_dir", data], ["predict", images]):
        sys.modules.pop("tests_pkg.mod", None)
        proc = run_cli(
            [command[0], "--checkpoint", ref, *command[1:]],
            env=clean_env(TESTS_PKG_IMPORTED=str(marker)),
        )
        assert (
            proc.returncode == 2
            and proc.stderr.strip().splitlines()[-1]
            == f"accel-train: error: {ref}/model_config.json names the model code"
            " tests_pkg.mod:build: importing it runs that code; if you trust it, pass"
            " --trust_model_code (or --model tests_pkg.mod:build)"
        ), proc.stderr
        assert not marker.exists() and "tests_pkg.mod" not in sys.modules
    proc = run_cli(["evaluate", "--checkpoint", ref, "--data_dir", data, "--trust_model_code"])
    assert float(
        re.search(r"test accuracy ([\d.]+)% on 40 samples", proc.stdout)[1]
    ) / 100 == pytest.approx(acc)
    proc = run_cli(
        [
            "predict",
            "--checkpoint",
            ref,
            "--format",
            "json",
            "--model",
            "tests_pkg.mod:build",
            images,
        ]
    )
    top = [json.loads(line)["top"][0]["class"] for line in proc.stdout.splitlines()]
    classes = meta["classes"]
    assert sum(classes.index(c) == y for c, y in zip(top, labels)) / len(labels) == pytest.approx(
        acc, abs=1 / 40
    )
    # --init_from rebuilds the module its model_config.json names, once trusted (refused otherwise:
    # test above)
    proc = run_cli(
        [
            "--init_from",
            ref,
            "--trust_model_code",
            "--data",
            "cifar10",
            "--data_dir",
            data,
            "--max_steps",
            "1",
            "--output_dir",
            tmp_path / "fine",
        ]
    )
    assert (
        proc.returncode == 0
        and "--init_from: --model tests_pkg.mod:build --model_kwargs '{}'" in proc.stderr
    )
    assert "loaded 6 tensors; none missing" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.launches
def test_a_model_wrong_on_one_rank_stops_every_rank_with_one_line(tmp_path, existing_run):
    # the check on one batch runs on every rank: rank 1's wrong logits are one line (said by the
    # main process), no rank trains, the output dir is untouched
    before = snapshot(existing_run)
    proc = launch(
        "2proc_cpu.yaml",
        [
            *SMALL,
            "--model",
            "tests_pkg.mod:build",
            "--model_kwargs",
            '{"out": "wrong_shape", "rank": 1}',
            "--output_dir",
            existing_run,
        ],
        env=clean_env(PYTHONPATH=python_path(TESTS)),
        check=False,
    )
    # (accelerate launch's, for any failed rank; launch.sh passes the 2 on)
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("accel-train: error:")]
    assert errors == [
        "accel-train: error: rank 1: --model tests_pkg.mod:build: its forward gives shape (2, 3)"
        " for a batch of shape (2, 3, 32, 32); it must give logits (2, 10) (num_classes=10, the"
        " data's)"
    ], proc.stderr[-3000:]
    # (torchrun's summary)
    assert proc.stderr.count("exitcode  : 2") == 2 and "ConfigError" not in proc.stderr
    assert snapshot(existing_run) == before


@pytest.mark.launches
def test_the_examples_train_on_two_ranks(tmp_path):
    # a model in a local file trained with --model (its folder is the working directory), and a
    # script calling train() with its own Dataset under accelerate launch: it returns the run's
    # metrics and outputs
    env = clean_env(PYTHONPATH=python_path(ROOT))
    proc = run(
        [
            "bash",
            ROOT / "examples" / "train_my_model.sh",
            "--epochs",
            "1",
            "--output_dir",
            tmp_path / "m",
        ],
        240,
        env,
        tmp_path,
    )
    assert proc.returncode == 0 and "2 process(es)" in proc.stderr, proc.stderr[-3000:]
    assert (
        json.loads((tmp_path / "m" / "model_config.json").read_text())["architecture"]
        == "my_model:build"
    )
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        CONFIGS / "2proc_cpu.yaml",
        ROOT / "examples" / "train_own_data.py",
        "--epochs",
        "2",
        "--output_dir",
        tmp_path / "d",
    ]
    proc = run(list(map(str, cmd)), 240, env, tmp_path)
    assert proc.returncode == 0 and "2 process(es)" in proc.stderr, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])  # printed once, by the main process
    rows = [json.loads(r) for r in (tmp_path / "d" / "metrics.jsonl").read_text().splitlines()]
    assert result["final_test_acc"] == rows[-1]["test_acc"] and result["epochs_run"] == 2
    # 256 samples, 2 ranks x 8 (the automatic batch): 16 steps an epoch
    assert result["step"] == rows[-1]["step"] == 32
    assert (
        result["model_file"] == str(tmp_path / "d" / "model.safetensors")
        and Path(result["model_file"]).is_file()
    )
    meta = json.loads((tmp_path / "d" / "model_config.json").read_text())
    # the script's own model under the name a later process imports it by, with the script's folder
    assert (
        meta["architecture"],
        meta["code_dir"],
        meta["classes"],
        meta["data"],
        meta["dataset"],
    ) == (
        "train_own_data:small_net",
        str(ROOT / "examples"),
        ["horizontal", "vertical"],
        "dataset",
        "Stripes",
    )
    said = [line for line in proc.stderr.splitlines() if "predict with: " in line]
    assert (
        len(said) == 1
        and f"accel-train predict --checkpoint {tmp_path / 'd'} --trust_model_code"
        " --mean R,G,B --std R,G,B IMAGE_OR_FOLDER"
        in said[0]
    ), said
    # the command the script's docstring gives predicts with it, from another folder
    docstring = (ROOT / "examples" / "train_own_data.py").read_text().split('"""')[1]
    predict = shlex.split(re.search(r"^ +(accel-train predict .*)$", docstring, re.M)[1])
    images = tmp_path / "my_images"
    images.mkdir()
    from PIL import Image

    for name, stripes in (("h.png", 0), ("v.png", 1)):
        pixels = (np.arange(16) // 2 % 2 * 255).astype(np.uint8)
        grid = (
            np.repeat(pixels[:, None], 16, 1) if stripes == 0 else np.repeat(pixels[None, :], 16, 0)
        )
        Image.fromarray(np.stack([grid] * 3, -1)).save(images / name)
    predict = [
        tmp_path / "d" if a == "/tmp/own_data" else images if a == "imgs/" else a
        for a in predict[1:]
    ]
    proc = run(
        [sys.executable, "-m", "accel_train", *map(str, predict), "--format", "json"],
        120,
        clean_env(),
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(Path(json.loads(line)["file"]).name for line in proc.stdout.splitlines()) == [
        "h.png",
        "v.png",
    ]
    # the script's run continued from its folder alone: its own settings (2 epochs, not the default
    # 30)
    cmd = [*cmd[:-4], "--output_dir", tmp_path / "d", "--resume", "auto"]
    proc = run(list(map(str, cmd)), 240, env, tmp_path)
    assert (
        proc.returncode == 0 and json.loads(proc.stdout.strip().splitlines()[-1])["step"] == 32
    ), proc.stderr[-3000:]
    assert "--epochs 2" in next(
        line for line in proc.stderr.splitlines() if "the run's own settings" in line
    )
    # launch.sh starts the script in the trainer's place (ACCEL_TRAIN_SCRIPT), with its flags
    proc = run(
        ["bash", ROOT / "launch.sh", "--dry-run", "--epochs", "1"],
        60,
        clean_env(ACCEL_TRAIN_SCRIPT="examples/train_own_data.py", NPROC_PER_NODE="2"),
        ROOT,
    )
    assert re.search(
        r"accelerate.commands.launch .*--num_processes 2 .*examples/train_own_data.py --epochs"
        r" 1 *$",
        proc.stdout.strip(),
    ), proc.stdout + proc.stderr


def test_a_config_yaml_names_your_model_as_the_flag_does(tmp_path):
    from accel_train.cli import parse_train_args

    (tmp_path / "c.yaml").write_text("model: tests_pkg.mod:build\nmodel_kwargs: '{\"width\": 4}'\n")
    cfg = parse_train_args(["--config", str(tmp_path / "c.yaml"), "--trust_model_code"])
    assert (cfg.model, cfg.model_kwargs_dict()) == ("tests_pkg.mod:build", {"width": 4})
    assert parse_train_args(
        ["--config", str(tmp_path / "c.yaml"), "--model", "tests_pkg.mod:build"]
    ).model_kwargs
    # a path read from a file is code to run: without the command line's consent, one line (a file's
    # own trust_model_code does not count)
    (tmp_path / "d.yaml").write_text("model: tests_pkg.mod:build\ntrust_model_code: true\n")
    for config in ("c.yaml", "d.yaml"):
        with pytest.raises(
            ConfigError, match="names the model code tests_pkg.mod:build.*--trust_model_code"
        ):
            parse_train_args(["--config", str(tmp_path / config)])


@pytest.mark.parametrize(
    "raised,status,line",
    [
        (
            ConfigError("--epochs must be >= 1, got 0"),
            2,
            "accel-train: error: --epochs must be >= 1, got 0",
        ),
        (
            Preempted("stopped by SIGTERM at step 3"),
            4,
            "accel-train: preempted: stopped by SIGTERM at step 3",
        ),
        (
            Diverged("the training loss became non-finite at step 2"),
            5,
            "accel-train: error: the training loss became non-finite at step 2",
        ),
        (None, 0, None),
    ],
)
def test_a_script_ends_with_the_command_lines_line_and_status(raised, status, line, capsys):
    # api.main(script): what a script's train() raised is the command line's one line and exit
    # status (launch.sh relaunches a preempted script with --restart_on_preempt, and never one that
    # had bad input)
    from accel_train.api import main

    def script():
        if raised is not None:
            raise raised

    with pytest.raises(SystemExit) as e:
        main(script)
    assert e.value.code == status
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1:] == ([line] if line else []) and "Traceback" not in "\n".join(err)


def test_a_script_that_returns_trains_result_ends_with_status_0(capsys):
    # main(lambda: train(...)) or a main that returns train()'s metrics: a dict is no exit status
    # (sys.exit(dict) printed it and exited 1; on 2 ranks os._exit(dict) raised); an int is the
    # script's own status
    from accel_train.api import main

    for returned, status in (({"final_test_acc": 0.5}, 0), (None, 0), (3, 3)):
        with pytest.raises(SystemExit) as e:
            main(lambda returned=returned: returned)
        assert e.value.code == status
    assert capsys.readouterr().err == ""


def test_train_takes_an_import_path_as_its_model(tmp_path):
    # model="module.path:callable" (as config.model takes it) is imported and built, not called as a
    # factory (it was recorded as builtins:str and called: "str(num_classes=10) raised TypeError")
    from accel_train import TrainConfig

    data = Items((torch.zeros(3, 8, 8), 1))
    with pytest.raises(
        ConfigError, match=r"^--model tests_pkg.mod:build: its forward gives shape \(2, 3\)"
    ):
        in_process_train(
            TrainConfig(output_dir=str(tmp_path / "out"), model_kwargs='{"out": "wrong_shape"}'),
            model="tests_pkg.mod:build",
            train_set=data,
            test_set=data,
            classes=10,
        )


def test_the_check_on_one_batch_moves_nothing_of_the_run():
    # the training-mode forward of the check (it sees a tuple only that mode returns) leaves the
    # BatchNorm statistics, the random state and the mode as they were: the run trains the same with
    # and without it. Lazy modules (no buffers until a first forward) pass it too
    from accel_train.model.own_model import check_forward

    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3),
        torch.nn.BatchNorm2d(4),
        torch.nn.Dropout(0.5),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(4, 10),
    )
    x, before = torch.randn(2, 3, 8, 8), {k: v.clone() for k, v in net.state_dict().items()}
    rng = torch.get_rng_state()
    check_forward(net, x, 10, "m:net")
    assert net.training and torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    lazy = torch.nn.Sequential(
        torch.nn.LazyConv2d(4, 3),
        torch.nn.LazyBatchNorm2d(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.LazyLinear(10),
    )
    check_forward(lazy, x, 10, "m:lazy")
    assert lazy[1].num_batches_tracked == 0 and lazy[1].running_mean.abs().sum() == 0


def test_the_check_on_one_batch_leaves_a_sync_batchnorms_training_forward_to_the_device(
    monkeypatch,
):
    # under a process group SyncBatchNorm's training forward is a collective that refuses CPU
    # tensors ("expected input tensor to be on GPU"), and the check runs before prepare() moves the
    # model: only eval mode is checked
    from accel_train.model.own_model import check_forward

    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3),
        torch.nn.SyncBatchNorm(4),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(4, 10),
    )
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    with pytest.raises(ValueError, match="SyncBatchNorm expected input tensor to be on GPU"):
        net.train()(torch.randn(2, 3, 8, 8))  # (the fact the exception rests on)
    check_forward(net, torch.randn(2, 3, 8, 8), 10, "m:sync")


def test_a_module_given_to_train_is_checked_on_one_batch(tmp_path):
    # a module (not a factory) is trained as it is: one whose head has 3 classes for data of 10 is
    # one line
    from accel_train import TrainConfig

    data = Items((torch.zeros(3, 8, 8), 1))
    with pytest.raises(
        ConfigError,
        match=r"--model tests_pkg.mod:Net: its forward gives shape \(2, 3\) for a batch of "
        r"shape \(2, 3, 8, 8\); it must give logits \(2, 10\)",
    ):
        in_process_train(
            TrainConfig(output_dir=str(tmp_path / "out"), epochs=1),
            model=tests_pkg.mod.Net(3),
            train_set=data,
            test_set=data,
            classes=10,
        )
    assert not (tmp_path / "out").exists()


@pytest.mark.launches
def test_your_model_compiles_with_channels_last_and_the_ema(tmp_path):
    # --compile for a model of your own (one fresh process: torch.compile's caches
    # belong to it): the module prepare() made is compiled, two graphs (train, eval) whatever the
    # batches, the EMA follows it and the export is a plain state dict of your class
    from test_matrix import COMPILED

    out = tmp_path / "out"
    proc = launch(
        "cpu.yaml",
        [
            "--model",
            "tests_pkg.mod:build",
            *SMALL,
            "--batch_size",
            "8",
            "--compile",
            "--channels_last",
            "--ema",
            "--output_dir",
            out,
        ],
        timeout=600,
        env=clean_env(PYTHONPATH=python_path(TESTS)),
    )
    assert re.findall(r"\bmodel (\w+(?:\(\w+)*\)*)", proc.stderr) == ["OptimizedModule(Net)"], (
        proc.stderr[-3000:]
    )
    assert {int(r): int(g) for r, g in COMPILED.findall(proc.stderr)} == {0: 2}, proc.stderr[-3000:]
    weights = load_file(out / "model.safetensors")
    assert set(weights) == set(tests_pkg.mod.Net(10).state_dict()) and all(
        w.isfinite().all() for w in weights.values()
    )
    meta = json.loads((out / "model_config.json").read_text())
    assert meta["architecture"] == "tests_pkg.mod:build" and "final_test_acc_ema" in meta["metrics"]
    ema = load_file(out / "model_ema.safetensors")
    assert set(ema) == set(weights) and any(not torch.equal(ema[k], weights[k]) for k in weights)


@pytest.mark.launches
def test_a_linear_probe_trains_on_two_ranks_under_the_default_precision(tmp_path):
    # every layer frozen but the classifier (requires_grad=False), on a CPU whose default is bf16:
    # the start-up check must not raise "element 0 of tensors does not require grad" (exit 2, even
    # under auto). The check runs, passes, and both ranks
    # train the classifier only
    from test_precision_check import BF16_CPU

    out = tmp_path / "out"
    env = clean_env(
        PYTHONPATH=python_path(TESTS),
        ACCEL_TRAIN_DEVICE_FACTS=BF16_CPU,
        NPROC_PER_NODE="2",
        XDG_CACHE_HOME=str(tmp_path / "cache"),
    )
    # (launch.sh picks the precision)
    proc = run(
        [
            "bash",
            ROOT / "launch.sh",
            *SMALL,
            "--batch_size",
            "8",
            "--model",
            "tests_pkg.mod:probe",
            "--data",
            "random",
            "--timeout_s",
            "60",
            "--output_dir",
            out,
        ],
        240,
        env,
        ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "launch.sh: precision bf16" in proc.stderr, proc.stderr[-3000:]
    assert re.search(r"precision check: bf16 gradients match fp32 .*\(head\.\w+\)", proc.stderr), (
        proc.stderr[-3000:]
    )
    assert "2 process(es) [DistributedType.MULTI_CPU, bf16]" in proc.stderr, proc.stderr[-3000:]
    assert steps_logged(out) >= 1 and (out / "model.safetensors").is_file()


@pytest.mark.launches
def test_a_model_with_an_unused_parameter_trains_on_two_ranks(tmp_path):
    # a parameter the forward never uses trains on 1 rank, and on 2 DDP stops at the second step
    # ("Expected to have finished reduction in the prior iteration", exit 1) unless told. The
    # start-up pass sees it and DDP is told (Accelerate's
    # DistributedDataParallelKwargs), said in one line
    out = tmp_path / "out"
    proc = launch(
        "2proc_cpu.yaml",
        [
            *SMALL,
            "--batch_size",
            "8",
            "--model",
            "tests_pkg.mod:with_unused",
            "--data",
            "random",
            "--log_every",
            "1",
            "--output_dir",
            out,
        ],
        env=clean_env(PYTHONPATH=python_path(TESTS)),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [ln for ln in proc.stderr.splitlines() if "get no gradient on a batch" in ln]
    assert (
        len(said) == 1
        and "2 trained parameters (spare.bias, spare.weight) get no gradient" in said[0]
        and "find_unused_parameters" in said[0]
    ), proc.stderr[-3000:]
    # 64 samples, 2 ranks x 8
    assert steps_logged(out) == 4 and (out / "model.safetensors").is_file()


class Mixed(Dataset):
    """32 good items (image, label 0 or 1) but the ones in `bad` (index: item)."""

    def __init__(self, bad):
        self.bad = bad

    def __len__(self):
        return 32

    def __getitem__(self, i):
        return self.bad.get(i, (torch.full((3, 8, 8), float(i % 2)), i % 2))


def test_a_bad_item_past_item_0_is_one_line_naming_its_index(tmp_path, existing_run):
    # not only item 0: a sample of items (evenly spaced: 0, 4, 9, ... 31 of
    # 32) is checked at start (nothing written); any other item as its batch is built (in a
    # DataLoader worker too: one line, not the worker's traceback), on the CPU before the batch
    # reaches the device (on CUDA a label out of range is a device-side assert)
    from PIL import Image

    from accel_train import TrainConfig

    before = snapshot(existing_run)
    for bad, said in (
        (
            {4: (Image.new("RGB", (8, 8)), 1)},
            "train_set[4] is (a PIL.Image.Image, a int); each item",
        ),
        (
            {9: (torch.zeros(3, 8, 8), 5)},
            (
                "train_set has label 5, but there are 2 classes (a, b): labels "
                "are 0..1 (train_set[9] is 5)"
            ),
        ),
        (
            {31: (torch.zeros(3, 4, 4), 1)},
            "train_set[31] is an image of shape (3, 4, 4), not (3, 8, 8)",
        ),
    ):
        with pytest.raises(ConfigError) as e:
            in_process_train(
                TrainConfig(output_dir=str(existing_run), epochs=1),
                model="tests_pkg.mod:build",
                train_set=Mixed(bad),
                test_set=Mixed({}),
                classes=["a", "b"],
            )
        assert said in str(e.value) and "\n" not in str(e.value), str(e.value)
        assert snapshot(existing_run) == before
    for workers in (0, 1):
        with pytest.raises(ConfigError) as e:
            in_process_train(
                TrainConfig(
                    output_dir=str(tmp_path / f"out{workers}"),
                    epochs=1,
                    batch_size=8,
                    num_workers=workers,
                ),
                model="tests_pkg.mod:build",
                train_set=Mixed({2: (torch.zeros(3, 8, 8), 7)}),
                test_set=Mixed({}),
                classes=["a", "b"],
            )
        assert (
            str(e.value)
            == "train_set[2] is label 7, outside 0..1 (2 classes); each item must be (image float "
            "tensor (C, H, W), int label), every image of one shape, labels 0..1"
        ), str(e.value)
    # the loaders read your Dataset through the check: its own set_epoch (and targets, classes)
    # still reach it
    from accel_train.data.given import Checked

    seen = Mixed({})
    seen.set_epoch = lambda epoch: setattr(seen, "epoch", epoch)
    Checked(seen, "train_set", (3, 8, 8), 2).set_epoch(3)
    assert seen.epoch == 3 and not hasattr(Checked(seen, "train_set", (3, 8, 8), 2), "__getitems__")
