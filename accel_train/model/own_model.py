"""Your own model: `--model module.path:callable` (imported on every rank), or a module / factory
given to `train()`; the trust rule for an import path read from a file; the checks that make a wrong
model one line (exit 2) before the first step (docs/own_data_and_models.md: Your own model)."""

from __future__ import annotations

import hashlib
import importlib
import inspect
import os
import sys
import sysconfig
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from torch.nn.parameter import is_lazy

from ..errors import ConfigError


@dataclass
class Given:
    """What a script passed to `accel_train.train()`: a module or a factory (None: --model), its own
    Datasets (None: --data) and, optionally, the class names (or count) of those."""

    model: object = None
    train_set: object = None
    test_set: object = None
    classes: object = None


def is_import_path(name) -> bool:
    """`module.path:callable` (a timm name has no colon)."""
    return isinstance(name, str) and ":" in name


def name_of(model) -> str:
    """The import path a module or factory given to train() is recorded under (config.yaml,
    model_config.json): a training script's own code under the script's importable name, never
    `__main__`, which a later process (predict, evaluate, a resume) would take for its own."""
    kind = model if callable(model) and not isinstance(model, nn.Module) else type(model)
    module = getattr(kind, "__module__", "__main__")
    if module == "__main__":
        module = main_module_name() or module
    return f"{module}:{getattr(kind, '__qualname__', type(kind).__name__)}"


def main_module_name() -> str | None:
    """The importable name of the code running as `__main__`: `python -m pkg.mod`'s pkg.mod, a
    `python path/script.py`'s file name (imported from its folder: code_dir); None for a notebook or
    `python -c`."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":
        return spec.name
    stem = Path(getattr(main, "__file__", None) or "").stem
    return stem if stem.isidentifier() else None


def code_dir(path: str | None) -> str | None:
    """The folder a later process imports an import path's module from (model_config.json's
    code_dir): the one that holds its top-level package or module file, for your own files (None:
    a timm name, an installed package, or a module with no file)."""
    if not is_import_path(path):
        return None
    name = path.partition(":")[0]
    module = sys.modules.get("__main__") if name == main_module_name() else sys.modules.get(name)
    if module is None or not is_local(module):
        return None
    folder = Path(module.__file__).resolve().parent
    for _ in range(name.count(".") + (Path(module.__file__).name == "__init__.py")):
        folder = folder.parent
    return str(folder)


def search_code_dir(folder: str | None) -> None:
    """Let import_callable find a module in `folder` (after the working directory and PYTHONPATH):
    the recorded code_dir of a trained model's own code."""
    if folder and Path(folder).is_dir() and folder not in sys.path:
        sys.path.append(folder)


def same_callable(named: str | None, recorded: str | None) -> bool:
    """`--model mod:f` names the model that model_config.json records as `__main__:f` (written by
    an earlier accel_train from a script run as __main__)."""
    return bool(
        named
        and recorded
        and recorded.startswith("__main__:")
        and is_import_path(named)
        and named.partition(":")[2] == recorded.partition(":")[2]
    )


def code_digest(name, model: nn.Module | None = None) -> str | None:
    """The code a cached result about the model (the precision check) belongs to, as a digest: the
    file that defines an import path's module, and the files that define the model's modules (every
    class of every submodule, and its bases: timm's and torch's too) with, for your own files, those
    of the code they import (a layer in a second local module: its forward changed, the model is
    checked again). None when nothing of it can be read."""
    module = sys.modules.get(name.partition(":")[0]) if is_import_path(name) else None
    modules = {module} if module is not None else set()
    if model is not None:
        modules |= {sys.modules.get(c.__module__) for m in model.modules() for c in type(m).__mro__}
    # one level: what your own files import
    for mod in [m for m in modules if m is not None and is_local(m)]:
        modules |= {
            v if inspect.ismodule(v) else sys.modules.get(getattr(v, "__module__", None) or "")
            for v in vars(mod).values()
            if inspect.ismodule(v) or inspect.isfunction(v) or inspect.isclass(v)
        }
    digest, read = hashlib.sha256(), False
    for mod in sorted((m for m in modules if m is not None), key=lambda m: m.__name__):
        try:
            digest.update(mod.__name__.encode() + Path(mod.__file__).read_bytes())
            read = True
        except (OSError, TypeError, AttributeError):  # (a builtin module, a notebook's __main__)
            pass
    return digest.hexdigest()[:16] if read else None


def is_local(module) -> bool:
    """A module of your own files: not the standard library's or an installed package's."""
    installed = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    path = getattr(module, "__file__", None)
    return bool(path) and not any(
        os.path.abspath(path).startswith(os.path.abspath(p) + os.sep) for p in installed
    )


def structure_digest(model: nn.Module) -> str:
    """The model's modules (their repr: types and sizes) and its tensors' names and shapes, as a
    digest: two models recorded under one name (a notebook's `__main__:Net` of another width, a
    functools.partial, instances of one class built with other arguments) are not one model to a
    cached result about the model (the precision check)."""
    shapes = [(k, tuple(v.shape)) for k, v in model.state_dict().items()]
    return hashlib.sha256(f"{model!r}{shapes}".encode()).hexdigest()[:16]


def one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: " + " ".join(str(e).split())[:300]


def import_callable(path: str):
    """`module.path:callable` -> the callable. The working directory is searched first, as
    `python -m` does (and `accelerate launch -m` / launch.sh on every rank), then PYTHONPATH and the
    installed packages."""
    module_name, _, attr = path.partition(":")
    if (
        not module_name
        or not attr
        or not all(part.isidentifier() for part in (*module_name.split("."), attr))
    ):
        raise ConfigError(
            f"--model {path!r} is neither a timm name nor an import path "
            "module.path:callable (e.g. my_models:build)"
        )
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            searched = [
                os.getcwd(),
                *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)),
            ]
            raise ConfigError(
                f"--model {path}: no module named {e.name!r} (searched the working "
                f"directory and PYTHONPATH: {', '.join(dict.fromkeys(searched))}, "
                "then the installed packages); run from the folder that holds it or "
                "add that folder to PYTHONPATH"
            ) from None
        raise ConfigError(
            f"--model {path}: importing {module_name} failed ({one_line(e)})"
        ) from None
    except Exception as e:  # the module's own code raised (a SyntaxError too)
        raise ConfigError(
            f"--model {path}: importing {module_name} failed ({one_line(e)})"
        ) from None
    factory = getattr(module, attr, None)
    if factory is None:
        have = sorted(
            k
            for k, v in vars(module).items()  # what the module itself defines
            if callable(v)
            and not k.startswith("_")
            and getattr(v, "__module__", None) == module_name
        )[:8]
        raise ConfigError(
            f"--model {path}: {module_name} ({getattr(module, '__file__', '?')}) has no {attr!r}"
            + (f"; it has {', '.join(have)}" if have else "")
        )
    if not callable(factory):
        raise ConfigError(
            f"--model {path}: {attr} is a {type(factory).__name__}, not a callable "
            "that returns an nn.Module"
        )
    return factory


def build(factory, num_classes: int, kwargs: dict, name: str) -> nn.Module:
    """factory(num_classes=..., **kwargs), or the module itself; checked to be a trainable
    nn.Module."""
    if isinstance(factory, nn.Module):
        model = factory
    else:
        try:
            model = factory(num_classes=num_classes, **kwargs)
        except Exception as e:
            call = ", ".join(
                [f"num_classes={num_classes}", *(f"{k}={v!r}" for k, v in kwargs.items())]
            )
            raise ConfigError(
                f"--model {name}: {name.split(':')[-1]}({call}) raised {one_line(e)}"
                + ("; check --model_kwargs" if kwargs else "")
            ) from None
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"--model {name} returned a {type(model).__name__}, not a torch nn.Module"
        )
    if not any(True for _ in model.parameters()):
        raise ConfigError(
            f"--model {name}: the {type(model).__name__} it returned has no "
            "parameters: nothing to train"
        )
    return model


def check_forward(model: nn.Module, x: torch.Tensor, num_classes: int, name: str) -> None:
    """One batch through the model in eval mode and in training mode (no gradients; nothing of the
    run moves: `untouched`), before the first step and on every rank: each must give one tensor of
    logits (N, num_classes). (torchvision's GoogLeNet and Inception v3 with aux logits return a
    tuple in training mode only.)"""
    x = x.to(next(model.parameters()).device)
    for training in (False, True) if trains_here(model) else (False,):
        mode = " in training mode" if training else ""
        try:
            with untouched(model), torch.no_grad():
                out = model.train(training)(x)
        except Exception as e:
            raise ConfigError(
                f"--model {name}: its forward failed{mode} on a batch of shape "
                f"{tuple(x.shape)} ({one_line(e)})"
            ) from None
        check_logits(out, tuple(x.shape), num_classes, name, mode)


def trains_here(model: nn.Module) -> bool:
    """Whether a training-mode forward can run before prepare(). A SyncBatchNorm's is a collective,
    on the device only (torch/nn/modules/batchnorm.py, SyncBatchNorm.forward, once a process group
    exists), and the model is still on the CPU here: eval mode only."""
    return not any(isinstance(m, nn.SyncBatchNorm) for m in model.modules())


@contextmanager
def untouched(model: nn.Module):
    """The model's mode, its buffers (BatchNorm's running statistics; a lazy module's, made by a
    first forward, are left as made) and the random state as they were before."""
    was_training = model.training
    buffers = {n: b.detach().clone() for n, b in model.named_buffers() if not is_lazy(b)}
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        model.train(was_training)
        with torch.no_grad():
            for n, b in model.named_buffers():
                if n in buffers and b.shape == buffers[n].shape:
                    b.copy_(buffers[n])


def unused_parameters(model: nn.Module, x: torch.Tensor) -> list[str]:
    """The parameters that train (requires_grad) but get no gradient from one batch's logits: on N
    ranks DDP must look for them each step (its find_unused_parameters), else the second step fails
    ("Expected to have finished reduction in the prior iteration"). One forward and backward (.grad
    untouched), nothing of the run moved; [] if that pass fails (the first step says why)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    try:
        with untouched(model), torch.enable_grad():
            out = model.train(trains_here(model))(x.to(named[0][1].device))
            grads = torch.autograd.grad(out.float().sum(), [p for _, p in named], allow_unused=True)
    except Exception:
        return []
    return [n for (n, _), g in zip(named, grads) if g is None]


def check_logits(out, shape: tuple, num_classes: int, name: str, mode: str) -> None:
    want = (shape[0], num_classes)
    if not isinstance(out, torch.Tensor):
        raise ConfigError(
            f"--model {name}: its forward returns a {type(out).__name__}{mode}; it "
            f"must return one tensor of logits {want} (return only the logits)"
        )
    if tuple(out.shape) != want:
        raise ConfigError(
            f"--model {name}: its forward gives shape {tuple(out.shape)}{mode} for a "
            f"batch of shape {shape}; it must give logits {want} "
            f"(num_classes={num_classes}, the data's)"
        )


def allow_import(path: str, trusted: bool, named: str | None, where: str) -> None:
    """An import path read from a file (model_config.json) is code to run: import it only with
    --trust_model_code or when the command line names the same path (--model); timm names need
    neither."""
    if is_import_path(path) and not trusted and named != path:
        raise ConfigError(
            f"{where} names the model code {path}: importing it runs that code; if "
            f"you trust it, pass --trust_model_code (or --model {path})"
        )


def rebuild_problem(model: nn.Module, rebuild, x: torch.Tensor) -> str | None:
    """Why the import path a model given to train() is recorded under does not rebuild it (None: it
    does). `rebuild()` builds what model_config.json would make of it (that path, num_classes,
    model_kwargs, stem); that must have the same state-dict keys and shapes and, holding the same
    weights, give the same logits on `x` (eval mode). The weights are random ones, loaded into both
    (the model's own are restored after): a layer initialised to zero would hide a different
    activation. The model's buffers (e.g. running statistics) are kept."""
    try:
        with torch.random.fork_rng(devices=[]):
            rebuilt = rebuild()
    # the import or the call failed (a lambda, a local class, a functools.partial ...)
    except Exception as e:
        return str(e) if isinstance(e, ConfigError) else one_line(e)
    mine, theirs = model.state_dict(), rebuilt.state_dict()
    if mine.keys() != theirs.keys():
        return f"it has other tensors ({', '.join(sorted(set(mine) ^ set(theirs))[:3])})"
    for key, value in mine.items():
        if value.shape != theirs[key].shape:
            return (
                f"its {key} has shape {tuple(theirs[key].shape)}, the trained model's "
                f"{tuple(value.shape)}"
            )
    saved, was_training = {k: v.detach().clone() for k, v in mine.items()}, model.training
    params = {name for name, _ in model.named_parameters()}
    seed = torch.Generator().manual_seed(0)
    weights = {
        k: (
            torch.randn(v.shape, generator=seed).to(v.dtype)
            if k in params and v.is_floating_point()
            else v
        )
        for k, v in saved.items()
    }
    device = next(model.parameters()).device
    try:
        model.load_state_dict(weights)
        rebuilt.to(device).load_state_dict(weights)
        with torch.no_grad():
            a, b = (m.eval()(x.to(device)).float().cpu() for m in (model, rebuilt))
    except Exception as e:
        return f"it fails on the trained model's weights or a batch ({one_line(e)})"
    finally:
        model.load_state_dict(saved)
        model.train(was_training)
    if a.shape != b.shape or not torch.allclose(
        a, b, rtol=1e-4, atol=1e-5 * max(1.0, a.abs().max().item())
    ):
        worst = (a - b).abs().max().item() if a.shape == b.shape else float("nan")
        return f"it gives other logits for the same weights (up to {worst:.3g} apart)"
    return None
