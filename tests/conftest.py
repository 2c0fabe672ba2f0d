"""Shared helpers: CIFAR-10 files in the real pickle format, and real `accelerate launch` runs."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "accelerate_configs"


def cifar_arrays(n: int, rng: np.random.Generator, learnable: bool) -> tuple[np.ndarray, list[int]]:
    labels = rng.integers(0, 10, n)
    if learnable:
        # Class c: a fixed colour of its own plus noise; crops and flips keep it.
        colours = np.random.default_rng(1234).integers(30, 226, (10, 3))
        img = colours[labels][:, :, None].repeat(1024, axis=2).astype(np.int16)
        img += rng.integers(-25, 26, img.shape)
        data = np.clip(img, 0, 255).astype(np.uint8).reshape(n, 3072)
    else:
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
    return data, [int(v) for v in labels]


def write_batch(path: Path, data, labels, **extra) -> None:
    obj = {b"batch_label": path.name.encode(), b"labels": labels, b"data": data,
           b"filenames": [f"img_{i}.png".encode() for i in range(len(labels))], **extra}
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=2)


def write_cifar(root: Path, rows=(7, 5, 6, 9, 3), test_rows: int = 11, learnable: bool = False,
                seed: int = 0) -> Path:
    """<root>/cifar-10-batches-py in the real format, with any number of rows per batch file."""
    d = Path(root) / "cifar-10-batches-py"
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i, n in enumerate(rows, start=1):
        write_batch(d / f"data_batch_{i}", *cifar_arrays(n, rng, learnable))
    write_batch(d / "test_batch", *cifar_arrays(test_rows, rng, learnable))
    with open(d / "batches.meta", "wb") as f:
        pickle.dump({b"label_names": [b"airplane", b"automobile", b"bird", b"cat", b"deer", b"dog", b"frog",
                                      b"horse", b"ship", b"truck"], b"num_cases_per_batch": 10000}, f, protocol=2)
    return Path(root)


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ACCELERATE_", "MASTER_", "WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC"))}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TQDM_DISABLE="1", **extra)
    return env


def launch(config: str, args: list[str], timeout: float = 300, env: dict | None = None, check: bool = True,
           cwd=ROOT) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file accelerate_configs/<config> -m accel_train <args>`, as the README says."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / config),
           "-m", "accel_train", *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or clean_env(), cwd=cwd)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-6000:]}")
    return proc


def run_cli(args: list[str], timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m accel_train <args>` as a plain single process."""
    return subprocess.run([sys.executable, "-m", "accel_train", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env or clean_env(), cwd=ROOT)


@pytest.fixture
def cifar_dir(tmp_path):
    return write_cifar(tmp_path / "input_dir")
