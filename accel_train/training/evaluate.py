"""Evaluation: the function the training loop calls at each epoch's end (and `accel-train evaluate`
too): predictions and labels of the whole evaluation split, gathered over ranks, each sample counted
once."""

from __future__ import annotations

from typing import NamedTuple

import torch
from tqdm.auto import tqdm

from ..hang import PROGRESS
from ..resilience.preempt import AgreedChecks

# top-k accuracy beside top-1 where there are more than k classes (timm's validate: top-5)
TOP_K = 5
# an evaluation shows its progress bar once it has taken this long (a short one shows none)
BAR_AFTER_S = 3.0


class Evaluated(NamedTuple):
    """Per sample of the whole evaluation split, each counted once: the predicted class, the
    label, the cross-entropy of the predicted distribution (the TTA's mean) and whether the label
    is among the TOP_K most likely classes."""

    preds: torch.Tensor
    labels: torch.Tensor
    losses: torch.Tensor
    in_top_k: torch.Tensor

    def accuracy(self) -> float:
        return (self.preds == self.labels).float().mean().item()

    def metrics(self, num_classes: int, prefix: str = "test") -> dict:
        """The row's numbers: accuracy, mean loss and (more than TOP_K classes) top-5 accuracy."""
        row = {f"{prefix}_acc": self.accuracy(), f"{prefix}_loss": self.losses.mean().item()}
        if num_classes > TOP_K:
            row[f"{prefix}_top{TOP_K}"] = self.in_top_k.float().mean().item()
        return row


@torch.no_grad()
def evaluate(accelerator, model, loader, data, tta: bool = False, stop=None) -> Evaluated | None:
    """Predictions, labels, losses and top-k hits for the whole evaluation split, gathered over
    ranks, padding removed. `stop` (training): a StopRequest the ranks agree on every few seconds
    of batches (AgreedChecks); None is returned on every rank when it fires."""
    model.eval()
    parts = []
    checks = AgreedChecks(stop) if stop is not None else None
    size = None  # every batch is run at the first one's size: one input shape, one compiled graph
    bar = tqdm(
        loader,
        desc="evaluation",
        delay=BAR_AFTER_S,
        leave=False,
        dynamic_ncols=True,
        disable=not accelerator.is_main_process,
    )
    for i, batch in enumerate(bar):
        if checks is not None and checks.due(i) and checks.agree(accelerator, i):
            return None
        x, y = data.inputs(batch, train=False)
        size = size or len(x)
        x = pad_batch(x, size)
        with accelerator.autocast():
            log_p = model(x).float().log_softmax(1)
            if tta:  # (the mean of the two distributions)
                log_p = torch.logaddexp(log_p, model(x.flip(3)).float().log_softmax(1)) - LOG_2
            log_p = log_p[: len(y)]  # the padding rows go (eval mode: no row depends on another)
        labels = y.long()
        losses = -log_p.gather(1, labels[:, None])[:, 0]
        top = log_p.topk(min(TOP_K, log_p.shape[1]), 1).indices
        parts.append(
            accelerator.gather_for_metrics(
                (log_p.argmax(1), labels, losses, (top == labels[:, None]).any(1))
            )
        )
        PROGRESS.mark("evaluation", detail=f"batch {i + 1}")
    bar.close()
    return Evaluated(*(torch.cat(column).cpu() for column in zip(*parts)))


LOG_2 = 0.6931471805599453


def pad_batch(x: torch.Tensor, size: int) -> torch.Tensor:
    """`x` with its last row repeated up to `size` rows, in its memory format (a shorter last batch
    would make torch.compile compile another graph)."""
    if len(x) >= size:
        return x
    fmt = (
        torch.channels_last
        if x.dim() == 4
        and not x.is_contiguous()
        and x.is_contiguous(memory_format=torch.channels_last)
        else torch.contiguous_format
    )
    padded = torch.empty((size, *x.shape[1:]), dtype=x.dtype, device=x.device).contiguous(
        memory_format=fmt
    )
    padded[: len(x)] = x
    padded[len(x) :] = x[-1:]
    return padded
