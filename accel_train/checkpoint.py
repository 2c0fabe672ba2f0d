"""Checkpoints (accelerator.save_state, atomic, newest K kept), resume, and the safetensors export.

A checkpoint is `<output_dir>/checkpoints/step_<global step>/`: Accelerate's model.safetensors,
optimizer.bin, scaler.pt (fp16 only), random_states_<rank>.pkl for every rank, plus our
trainer_state.json (epoch, global step, batches done in the epoch, lr schedule, EMA file). It is
written as `.tmp-step_N/` by every rank and renamed into place by the main process once every rank
has finished: a directory named `step_N` is complete by construction.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .config import ConfigError

CKPT_DIR = "checkpoints"
STATE_FILE = "trainer_state.json"
EMA_FILE = "ema.safetensors"
MODEL_FILE = "model.safetensors"
MODEL_CONFIG_FILE = "model_config.json"


@dataclass
class TrainState:
    epoch: int = 0           # 0-based epoch in progress (== epochs done when batch_in_epoch == 0)
    step: int = 0            # optimizer steps done
    batch_in_epoch: int = 0  # batches of `epoch` already consumed (on each rank)


def checkpoint_dirs(output_dir) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(output_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step_*") if (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def resolve_resume(resume: str | None, output_dir) -> Path | None:
    if not resume:
        return None
    if resume == "auto":
        found = checkpoint_dirs(output_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / STATE_FILE).is_file() or not (path / MODEL_FILE).is_file():
        raise ConfigError(f"--resume {resume}: not a complete checkpoint (no {STATE_FILE} / {MODEL_FILE}); "
                          f"pass a {CKPT_DIR}/step_N directory or --resume auto")
    return path


def _state_dict_cpu(module: torch.nn.Module) -> dict:
    return {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}


def save_checkpoint(accelerator, output_dir, state: TrainState, scheduler, ema=None, keep: int = 2) -> Path:
    """Every rank calls this. Returns the final checkpoint path."""
    root = Path(output_dir) / CKPT_DIR
    final = root / f"step_{state.step:08d}"
    tmp = root / f".tmp-{final.name}"
    if accelerator.is_main_process:
        for stale in root.glob(".tmp-step_*"):  # left by a run killed while saving: never complete
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    if accelerator.is_main_process:
        if ema is not None:
            save_file(_state_dict_cpu(ema.module), tmp / EMA_FILE)
        meta = {**asdict(state), "scheduler": scheduler.state_dict(), "num_processes": accelerator.num_processes}
        with open(tmp / STATE_FILE, "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
    accelerator.wait_for_everyone()  # every rank's files are in tmp
    if accelerator.is_main_process:
        if final.exists():  # same step saved twice (epoch end == step checkpoint): the new one wins
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in checkpoint_dirs(output_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    if accelerator.is_local_main_process and tmp.exists():
        # another node whose output_dir is not shared with rank 0: its part cannot make a resumable
        # checkpoint on its own (resuming needs a shared output_dir), so it is not kept
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def load_checkpoint(accelerator, path: Path, scheduler, ema=None) -> TrainState:
    """Every rank calls this, after accelerator.prepare."""
    try:
        meta = json.loads((path / STATE_FILE).read_text())
        accelerator.load_state(str(path))
        if ema is not None and (path / EMA_FILE).is_file():
            ema.module.load_state_dict(load_file(path / EMA_FILE, device=str(accelerator.device)))
    except Exception as e:  # safetensors, pickle, torch and json each raise their own kinds
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ConfigError(f"checkpoint {path} is corrupt or incompatible ({first}); pass another one to "
                          "--resume or delete it") from None
    scheduler.load_state_dict(meta["scheduler"])
    return TrainState(epoch=meta["epoch"], step=meta["step"], batch_in_epoch=meta["batch_in_epoch"])


def export_model(model: torch.nn.Module, output_dir, model_config: dict, filename: str = MODEL_FILE) -> Path:
    """Plain state dict (no `module.` / `_orig_mod.` prefixes) as safetensors + model_config.json."""
    path = Path(output_dir) / filename
    save_file(_state_dict_cpu(model), path, metadata={"format": "pt", "architecture": model_config["architecture"]})
    with open(Path(output_dir) / MODEL_CONFIG_FILE, "w") as f:
        json.dump(model_config, f, indent=1)
    return path
