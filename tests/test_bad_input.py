"""Bad input: one line naming the fix, a non-zero exit, no traceback wall, existing outputs
untouched."""

import hashlib
import os
import pickle
import socket
import subprocess

import numpy as np
import pytest
from conftest import ROOT, Exploit, clean_env, run_cli, write_batch, write_cifar

from accel_train.cli import main


def snapshot(root):
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def existing_run(tmp_path):
    """An output directory from an earlier run: its files must survive any bad start."""
    out = tmp_path / "out"
    (out / "checkpoints" / "step_00000008").mkdir(parents=True)
    (out / "model.safetensors").write_bytes(os.urandom(256))
    (out / "metrics.jsonl").write_text('{"epoch": 1, "step": 8}\n')
    (out / "steps.jsonl").write_text('{"step": 8, "loss": 2.0, "lr": 0.1}\n')
    (out / "checkpoints" / "step_00000008" / "trainer_state.json").write_text("{}")
    return out


def corrupt(kind, root):
    """Return the data_dir for a CIFAR-10 tree broken in one way."""
    if kind == "missing_dir":
        return root / "does-not-exist"
    root.mkdir(parents=True, exist_ok=True)
    if kind == "no_cifar_dir":
        return root
    write_cifar(root)
    batch = root / "cifar-10-batches-py" / "data_batch_4"
    if kind == "truncated":
        batch.write_bytes(batch.read_bytes()[:-100])
    elif kind == "wrong_shape":
        write_batch(batch, np.zeros((5, 1024), np.uint8), [0] * 5)
    elif kind == "labels_out_of_range":
        write_batch(batch, np.zeros((5, 3072), np.uint8), [0, 1, 2, 11, 3])
    elif kind == "code_pickle":
        with open(batch, "wb") as f:
            pickle.dump({b"data": Exploit(root / "pwned"), b"labels": [0]}, f, protocol=2)
    return root


CASES = {  # name: (extra args or a data corruption, message fragment)
    "missing_dir": ("data", "does not exist; pass --data_dir"),
    "no_cifar_dir": ("data", "has no cifar-10-batches-py/ folder"),
    "truncated": ("data", "is truncated or corrupt"),
    "wrong_shape": ("data", "must be an N x 3072 uint8 array"),
    "labels_out_of_range": ("data", "labels must be in 0..9"),
    "code_pickle": ("data", "it was not executed"),
    "unknown_model": (["--model", "resnet_does_not_exist"], "unknown timm model"),
    "global_batch_too_large": (
        ["--train_samples", "8", "--batch_size", "16"],
        "cannot fill one batch of 16 on each of 1 processes",
    ),
    "resume_missing": (["--resume", "/nonexistent/ckpt"], "not a complete checkpoint"),
    # the recipe's flags
    # (its nearest names: tests/test_optim.py)
    "unknown_optimizer": (
        ["--opt", "adamww"],
        "--opt adamww: ",
    ),
    "freeze_unknown_module": (
        ["--freeze", "layer9"],
        "--freeze layer9: ResNet has no module 'layer9'",
    ),
    "pretrained_path_missing": (["--pretrained_path", "/nonexistent.safetensors"], "no such file"),
    "mixup_odd_batch": (["--mixup", "0.8", "--batch_size", "15"], "--batch_size 15 must be even"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input(case, tmp_path, existing_run):
    spec, fragment = CASES[case]
    args = [
        "--train_samples",
        "64",
        "--test_samples",
        "16",
        "--epochs",
        "1",
        "--batch_size",
        "16",
        "--output_dir",
        existing_run,
    ]
    if spec == "data":
        args += ["--data", "cifar10", "--data_dir", corrupt(case, tmp_path / "in")]
    else:
        args += spec
    before = snapshot(existing_run)
    proc = run_cli(args)
    # bad input's status (launch.sh does not relaunch it)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert (
        len(errors) == 1 and errors[0].startswith("accel-train: error: ") and fragment in errors[0]
    ), proc.stderr
    assert snapshot(existing_run) == before
    assert not (tmp_path / "in" / "pwned").exists()


# Bad flags refused by argument parsing (cmd_train -> parse_train_args / TrainConfig raise
# ConfigError before anything is imported or touched): the same cli.main() path in-process, no
# interpreter to start.
PARSE_CASES = {
    "non_numeric_lr": (["--lr", "fast"], "invalid float value: 'fast'"),
    "negative_epochs": (["--epochs", "-3"], "--epochs must be >= 1"),
    "config_unknown_key": ("yaml", "unknown key(s) lr_typo"),
}


@pytest.mark.parametrize("case", sorted(PARSE_CASES))
def test_bad_flags_are_refused_by_parsing(case, tmp_path, existing_run, capsys, monkeypatch):
    spec, fragment = PARSE_CASES[case]
    monkeypatch.delenv("ACCEL_TRAIN_STATUS_DIR", raising=False)
    args = [
        "--train_samples",
        "64",
        "--test_samples",
        "16",
        "--epochs",
        "1",
        "--batch_size",
        "16",
        "--output_dir",
        str(existing_run),
    ]
    if spec == "yaml":
        (tmp_path / "c.yaml").write_text("epochs: 2\nlr_typo: 0.1\n")
        args += ["--config", str(tmp_path / "c.yaml")]
    else:
        args += spec
    before = snapshot(existing_run)
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert (
        len(errors) == 1 and errors[0].startswith("accel-train: error: ") and fragment in errors[0]
    ), err
    assert snapshot(existing_run) == before


def test_unwritable_output_dir(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    # a real `python -m accel_train`: bad input's status through the process's exit (the other cases
    # run in-process)
    proc = run_cli(
        ["--train_samples", "64", "--epochs", "1", "--output_dir", blocker / "out"], fresh=True
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith("accel-train: error: cannot create output directory")
    )
    assert blocker.read_text() == "not a directory"


def test_accelerate_config_with_unknown_key(tmp_path, existing_run):
    bad = tmp_path / "bad.yaml"
    bad.write_text((ROOT / "accelerate_configs" / "cpu.yaml").read_text() + "num_proceses: 2\n")
    before = snapshot(existing_run)
    proc = subprocess.run(
        ["bash", ROOT / "launch.sh", "--accel_config", bad, "--output_dir", existing_run],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(),
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "is invalid" in lines[0] and "num_proceses" in lines[0]
    assert snapshot(existing_run) == before


def test_rendezvous_port_already_in_use(tmp_path, existing_run):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = clean_env(NNODES="2", NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        before = snapshot(existing_run)
        proc = subprocess.run(
            ["bash", ROOT / "launch.sh", "--output_dir", existing_run],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    failures = [
        line for line in proc.stderr.splitlines() if "FAILED" in line or "error" in line.lower()
    ]
    assert len(failures) == 1 and f"port {port} is already in use" in failures[0], proc.stderr
    assert snapshot(existing_run) == before


SEEDS = {"negative": ["--seed", "-1"], "two_to_the_32": ["--seed", str(2**32)], "in_config": "yaml"}


@pytest.mark.parametrize("case", sorted(SEEDS))
def test_a_seed_out_of_numpys_range_is_one_line_and_leaves_no_output_dir(case, tmp_path):
    """numpy seeds 0..2**32-1 only: a seed outside it was accelerate's set_seed traceback (exit 1)
    after the output dir and its lock file were made. Refused where the flags are read, before
    anything is touched.
    """
    out = tmp_path / "out"
    args = [
        "--data",
        "random",
        "--train_samples",
        "64",
        "--test_samples",
        "16",
        "--epochs",
        "1",
        "--batch_size",
        "16",
        "--output_dir",
        out,
    ]
    if SEEDS[case] == "yaml":
        (tmp_path / "c.yaml").write_text(f"seed: {2**70}\n")
        args += ["--config", tmp_path / "c.yaml"]
    else:
        args += SEEDS[case]
    proc = run_cli(args)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr[
        -3000:
    ]
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith(
        "accel-train: error: --seed must be in 0..4294967295"
    ), errors
    assert not out.exists(), sorted(out.rglob("*"))


def test_a_seed_out_of_range_is_refused_by_the_api_before_the_output_dir(tmp_path):
    from accel_train import TrainConfig, train
    from accel_train.errors import ConfigError

    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=r"^--seed must be in 0\.\.4294967295"):
        TrainConfig(data="random", seed=-1, output_dir=str(out))
    cfg = TrainConfig(
        data="random",
        train_samples=64,
        test_samples=16,
        epochs=1,
        batch_size=16,
        output_dir=str(out),
    )
    cfg.seed = 2**32  # (a config changed after it was made: train() checks it again)
    with pytest.raises(ConfigError, match=r"^--seed must be in 0\.\.4294967295"):
        train(cfg)
    assert not out.exists(), sorted(out.rglob("*"))


def test_links_planted_in_an_output_dir_are_never_written_through(tmp_path):
    # another local user (uid 65534) made out/ and planted links where the run writes its lock and
    # its config; the run, as root, is refused in one line and both victims keep their bytes
    out = tmp_path / "out"
    out.mkdir()
    victims = {name: tmp_path / f"victim_{name}.txt" for name in ("lock", "cfg")}
    for victim in victims.values():
        victim.write_text("root's own data\n")
    os.symlink(victims["lock"], out / ".accel_train.lock")
    os.symlink(victims["cfg"], out / "config.yaml")
    for path in (out, out / ".accel_train.lock", out / "config.yaml"):
        os.lchown(path, 65534, 65534)
    os.chmod(out, 0o777)
    args = [
        "--model",
        "test_resnet",
        "--train_samples",
        "32",
        "--test_samples",
        "8",
        "--batch_size",
        "16",
        "--epochs",
        "1",
        "--output_dir",
        out,
    ]
    proc = run_cli(args)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("accel-train: error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert (
        ".accel_train.lock -> " in errors[0]
        and "config.yaml -> " in errors[0]
        and "never writes" in errors[0]
    )
    assert all(v.read_text() == "root's own data\n" for v in victims.values())
    # a link made while the run goes on (after the start's look) is not written through either
    from accel_train.config.train_config import TrainConfig
    from accel_train.errors import ConfigError
    from accel_train.files import open_output, write_output

    for write in (
        lambda p: TrainConfig().save_yaml(p),
        lambda p: write_output(p, b"x"),
        lambda p: open_output(p, "a").write("x"),
    ):
        with pytest.raises(
            ConfigError, match=r"config.yaml is a link \(to \S+victim_cfg.txt\): accel_train never"
        ):
            write(out / "config.yaml")
    assert victims["cfg"].read_text() == "root's own data\n"
    from accel_train.checkpoint.output_dir import hold_output_dir

    (out / "config.yaml").unlink()
    with pytest.raises(ConfigError, match=r"holds .accel_train.lock -> "):
        hold_output_dir(out)
    from accel_train.checkpoint.output_dir import open_lock_file

    with pytest.raises(ConfigError, match=r".accel_train.lock is a link"):
        open_lock_file(out / ".accel_train.lock")
    assert victims["lock"].read_text() == "root's own data\n"
