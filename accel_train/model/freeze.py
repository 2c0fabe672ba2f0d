"""--freeze: a linear probe (`backbone`: everything but the classifier) or partial fine-tuning (a
module name: every parameter registered up to and with that module, e.g. `layer3` of a ResNet,
`blocks.5` of a ViT).

Frozen parameters get requires_grad False before the optimizer is built: timm's parameter grouping
leaves them out of the optimizer, DDP neither reduces nor waits for them, and the start-up precision
check skips their layers. A frozen BatchNorm keeps its running statistics: it stays in eval mode
whatever model.train() says (FrozenNorm), so a frozen part's weights and buffers end bit-identical
to where they started.

Not timm.utils.freeze: it swaps BatchNorm2d for torchvision's FrozenBatchNorm2d, whose state dict
has no num_batches_tracked, so the exports would no longer load strictly into timm.create_model's
model (evaluate, timm's validate.py) and would not fit a checkpoint of the same model unfrozen.
"""

from __future__ import annotations

import torch.nn as nn

from ..errors import ConfigError

BACKBONE = "backbone"
_FROZEN_CLASSES: dict[type, type] = {}


def frozen_norm_class(cls: type) -> type:
    """A subclass of a BatchNorm class whose train() keeps it in eval mode (its running statistics
    fixed); the state dict, the forward and the class's own extras (timm's BatchNormAct2d
    activation) are the class's."""
    if cls not in _FROZEN_CLASSES:

        def train(self, mode: bool = True):
            return cls.train(self, False)

        _FROZEN_CLASSES[cls] = type(
            f"Frozen{cls.__name__}", (cls,), {"train": train, "__module__": cls.__module__}
        )
    return _FROZEN_CLASSES[cls]


def frozen_names(model: nn.Module, spec: str) -> list[str]:
    """The parameters --freeze `spec` freezes, in registration order."""
    names = [n for n, _ in model.named_parameters()]
    if spec == BACKBONE:
        head = model.get_classifier() if callable(getattr(model, "get_classifier", None)) else None
        if not isinstance(head, nn.Module) or not any(True for _ in head.parameters()):
            raise ConfigError(
                "--freeze backbone needs the model's classifier (timm's "
                f"get_classifier()); {type(model).__name__} names none: pass "
                "--freeze with the last module to freeze (one of "
                f"{_children(model)})"
            )
        keep = {id(p) for p in head.parameters()}
        return [n for n, p in model.named_parameters() if id(p) not in keep]
    inside = [i for i, n in enumerate(names) if n.startswith(spec + ".")]
    if not inside:
        raise ConfigError(
            f"--freeze {spec}: {type(model).__name__} has no module {spec!r} with "
            "parameters; pass 'backbone' or a module name such as "
            f"{_children(model)}"
        )
    if inside[-1] == len(names) - 1:
        raise ConfigError(
            f"--freeze {spec} would freeze every parameter (it holds the last ones, "
            "the classifier's); name an earlier module, or --freeze backbone for a "
            "linear probe"
        )
    return names[: inside[-1] + 1]


def freeze(model: nn.Module, spec: str) -> str:
    """Freeze `spec`'s parameters (and the BatchNorm layers all of whose parameters are frozen) in
    place; the line to log."""
    names = set(frozen_names(model, spec))
    params = dict(model.named_parameters())
    for name in names:
        params[name].requires_grad_(False)
    norms = 0
    for module in model.modules():
        own = list(module.parameters(recurse=False))
        if (
            isinstance(module, nn.modules.batchnorm._BatchNorm)
            and own
            and not any(p.requires_grad for p in own)
        ):
            module.__class__ = frozen_norm_class(type(module))
            norms += 1
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return (
        f"--freeze {spec}: {len(names)} of {len(params)} parameter tensors frozen ({norms} "
        f"BatchNorm layers with their running statistics); {trained:,} of {total:,} weights "
        "train"
    )


def _children(model: nn.Module) -> str:
    return ", ".join(n for n, m in model.named_children() if any(True for _ in m.parameters()))[
        :200
    ]
