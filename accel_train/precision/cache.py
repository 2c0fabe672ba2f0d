"""The precision check's cache (check.py): one small JSON file per (model and its code, input,
precision, memory format, device, torch version, check version), under
~/.cache/accel_train/precision_checks/ ($XDG_CACHE_HOME), as accel_config.py remembers configs. A
cache that cannot be read or written only means the check runs again."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from ..files import cache_dir
from ..model.own_model import code_digest, structure_digest

# in the cache key: a verdict of another version of the check is not reused (3: each layer alone
# checked too)
CHECK_VERSION = 3


def cache_key(cfg, num_classes: int, shape, precision: str, facts, model) -> dict:
    """What the verdict depends on: the model (its modules and shapes, and the code that runs them:
    user.code_digest; which parameters train), the input, the precision, the memory format, the
    device (its name is generic on many CPUs: its flags too, and oneDNN's ISA cap, which picks other
    kernels), torch, and this check."""
    return dict(
        check=CHECK_VERSION,
        model=cfg.model,
        code=code_digest(cfg.model, model),
        structure=structure_digest(model),
        stem=cfg.stem,
        model_kwargs=cfg.model_kwargs_dict(),
        drop=[cfg.drop_path, cfg.drop_rate],
        classes=num_classes,
        # the frozen parameters: a linear probe's verdict checked the classifier only, never
        # the backbone
        frozen=hashlib.sha256(
            " ".join(n for n, p in model.named_parameters() if not p.requires_grad).encode()
        ).hexdigest()[:16],
        input=list(shape),
        precision=precision,
        channels_last=bool(cfg.channels_last),
        device=[facts.kind, facts.name, facts.capability, sorted(facts.cpu_flags), facts.arch],
        isa=[os.environ.get(v, "") for v in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")],
        torch=torch.__version__,
    )


def cache_file(key: dict) -> Path | None:
    root = cache_dir("precision_checks")
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
    return root / f"{digest}.json" if root is not None else None


def cached(key: dict) -> dict | None:
    """The verdict remembered under `key` (verdict.Verdict.to_json's), or None."""
    path = cache_file(key)
    try:
        verdict = json.loads(path.read_text()) if path is not None and path.is_file() else None
        return (
            verdict if isinstance(verdict, dict) and verdict.get("check") == CHECK_VERSION else None
        )
    except (OSError, ValueError):
        return None


def remember(key: dict, verdict: dict) -> None:
    path = cache_file(key)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({**verdict, "check": CHECK_VERSION}))
        tmp.replace(path)
    except OSError:
        pass
