"""Trust to import model code: it comes only from the command line
(--trust_model_code, or --model naming the same path) or the train() call, never from a file: not a
--config YAML, not a config.yaml or model_config.json in an --init_from / --resume / evaluate /
predict folder. Every entry point that reads such a file is tried with a folder that asks for trust;
the payload's code must not run (it would touch a marker file) and the refusal is one line, exit 2,
naming the flag to pass."""

import json
import sys

import pytest
import torch
import yaml
from conftest import ROOT, clean_env, run, run_cli
from safetensors.torch import save_file

TINY = ["--train_samples", "32", "--test_samples", "16", "--batch_size", "16", "--image_size", "16"]
PAYLOAD = "tests_pkg.mod:build"  # its import touches $TESTS_PKG_IMPORTED


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """A real run's output folder of a model built by code (model_config.json and the checkpoints
    name it), whose config.yaml was made to grant itself trust and to start from that folder, as a
    shared folder could.
    """
    folder = tmp_path_factory.mktemp("trust") / "shared_run"
    proc = run_cli(
        [
            "--model",
            PAYLOAD,
            *TINY,
            "--max_steps",
            "2",
            "--checkpoint_every",
            "1",
            "--output_dir",
            folder,
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    sys.modules.pop(PAYLOAD.split(":")[0], None)
    conf = yaml.safe_load((folder / "config.yaml").read_text())
    conf.update(model="resnet18", init_from=str(folder), trust_model_code=True, stem="auto")
    (folder / "config.yaml").write_text(yaml.safe_dump(conf))
    return folder


def refused(args, marker, tmp_path) -> str:
    """Run `args`; it must exit 2 with one error line and without importing the payload; returns
    that line."""
    sys.modules.pop(PAYLOAD.split(":")[0], None)
    proc = run_cli(args, env=clean_env(TESTS_PKG_IMPORTED=str(marker)))
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert not marker.exists() and PAYLOAD.split(":")[0] not in sys.modules, (
        "the payload's code ran"
    )
    assert "Traceback" not in proc.stderr
    return errors[0]


@pytest.mark.parametrize(
    "entry", ["config", "config_resume", "init_from", "evaluate", "predict", "resume"]
)
def test_a_folder_cannot_grant_itself_trust(entry, shared, tmp_path):
    out, marker = tmp_path / "out", tmp_path / "imported"
    ask = (
        f"names the model code {PAYLOAD}: importing it runs that code; if you trust it, pass"
        " --trust_model_code"
    )
    args, said = {
        "config": (["--config", shared / "config.yaml", "--output_dir", out], ask),
        "config_resume": (["--config", shared / "config.yaml", "--resume", "auto"], ask),
        "init_from": (["--init_from", shared, *TINY, "--output_dir", out], ask),
        "evaluate": (["evaluate", "--checkpoint", shared], ask),
        "predict": (["predict", "--checkpoint", shared, ROOT / "README.md"], ask),
        # the checkpoint's model is not taken from it: the command line names it (a flag to pass,
        # not an import)
        "resume": (
            ["--resume", shared / "checkpoints" / "step_00000002", *TINY, "--output_dir", shared],
            f"--model 'resnet18' differs from the checkpoint's '{PAYLOAD}'",
        ),
    }[entry]
    before = sorted(p.name for p in shared.rglob("*"))
    line = refused(args, marker, tmp_path)
    assert line.startswith("accel-train: error: ") and said in line, line
    assert sorted(p.name for p in shared.rglob("*")) == before and not out.exists()


def test_a_file_trusts_nothing_but_the_command_line_and_train_do(tmp_path):
    from accel_train.cli import parse_train_args

    (tmp_path / "c.yaml").write_text("trust_model_code: true\nepochs: 3\n")
    assert parse_train_args(["--config", str(tmp_path / "c.yaml")]).trust_model_code is False
    assert (
        parse_train_args(
            ["--config", str(tmp_path / "c.yaml"), "--trust_model_code"]
        ).trust_model_code
        is True
    )
    cfg = parse_train_args(["--trust_model_code", "--epochs", "3"])
    cfg.save_yaml(tmp_path / "config.yaml")  # a run's config.yaml does not pass its trust on
    assert "trust_model_code" not in yaml.safe_load((tmp_path / "config.yaml").read_text())


def test_a_shared_folder_that_asks_for_trust_runs_no_code(tmp_path):
    # a real process: payload.py in the shared folder, imported as
    # shared_run.payload from the working directory, and a config.yaml that asks for trust
    folder, marker = tmp_path / "shared_run", tmp_path / "payload_ran"
    folder.mkdir()
    (folder / "payload.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nimport torch\n"
        "def build(num_classes):\n    return torch.nn.Linear(3, num_classes)\n"
    )
    (folder / "model_config.json").write_text(
        json.dumps({"architecture": "shared_run.payload:build"})
    )
    save_file({"weight": torch.zeros(2, 3), "bias": torch.zeros(2)}, folder / "model.safetensors")
    (folder / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "init_from": "shared_run",
                "trust_model_code": True,
                "output_dir": str(tmp_path / "out"),
            }
        )
    )
    # (this checkout's accel_train, from another folder)
    proc = run(
        [sys.executable, "-m", "accel_train", "--config", "shared_run/config.yaml"],
        120,
        clean_env(PYTHONPATH=str(ROOT)),
        tmp_path,
    )
    assert proc.returncode == 2 and not marker.exists(), proc.stderr[-3000:]
    assert (
        proc.stderr.strip().splitlines()[-1]
        == "accel-train: error: --init_from shared_run names the model code"
        " shared_run.payload:build: importing it runs that code; if you trust it, pass"
        " --trust_model_code (or --model shared_run.payload:build)"
    ), proc.stderr
