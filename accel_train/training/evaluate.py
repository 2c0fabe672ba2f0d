"""Evaluation: the function the training loop calls at each epoch's end (and `accel-train evaluate`
too): predictions and labels of the whole evaluation split, gathered over ranks, each sample counted
once."""

from __future__ import annotations

import torch

from ..hang import PROGRESS
from ..resilience.preempt import AgreedChecks


@torch.no_grad()
def evaluate(accelerator, model, loader, data, tta: bool = False,
             stop=None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Predictions and labels for the whole evaluation split, gathered over ranks, padding removed.
    `stop` (training): a StopRequest the ranks agree on every few seconds of batches (AgreedChecks);
    None is returned on every rank when it fires."""
    model.eval()
    all_preds, all_labels = [], []
    checks = AgreedChecks(stop) if stop is not None else None
    size = None  # every batch is run at the first one's size: one input shape, one compiled graph
    for i, batch in enumerate(loader):
        if checks is not None and checks.due(i) and checks.agree(accelerator, i):
            return None
        x, y = data.inputs(batch, train=False)
        size = size or len(x)
        x = pad_batch(x, size)
        with accelerator.autocast():
            scores = model(x).float().softmax(1)
            if tta:
                scores = scores + model(x.flip(3)).float().softmax(1)
            scores = scores[:len(y)]  # the padding rows go (eval mode: no row depends on another)
        preds, y = accelerator.gather_for_metrics((scores.argmax(1), y))
        all_preds.append(preds)
        all_labels.append(y)
        PROGRESS.mark("evaluation", detail=f"batch {i + 1}")
    return torch.cat(all_preds).cpu(), torch.cat(all_labels).cpu()


def pad_batch(x: torch.Tensor, size: int) -> torch.Tensor:
    """`x` with its last row repeated up to `size` rows, in its memory format (a shorter last batch
    would make torch.compile compile another graph)."""
    if len(x) >= size:
        return x
    fmt = torch.channels_last if x.dim() == 4 and not x.is_contiguous() and \
        x.is_contiguous(memory_format=torch.channels_last) else torch.contiguous_format
    padded = torch.empty((size, *x.shape[1:]), dtype=x.dtype,
                         device=x.device).contiguous(memory_format=fmt)
    padded[:len(x)] = x
    padded[len(x):] = x[-1:]
    return padded
