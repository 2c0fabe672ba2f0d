"""The non-finite watch: a loss or weights that became NaN/inf stop every rank at the same step, without a
host sync per step, and nothing non-finite is exported or checkpointed (exit status 5)."""

from __future__ import annotations

import torch

from .errors import Diverged
from .files import checkpoint_dirs


class NonFiniteWatch:
    """Notes on the device, per micro-batch and without a host sync, the first step whose loss is not
    finite; `check` reads that back on every rank at a point where the ranks meet anyway and raises
    `Diverged` on all of them together."""

    def __init__(self, device, output_dir):
        self.first = torch.zeros((), device=device, dtype=torch.long)  # 0: every loss so far finite
        self.lrs: dict[int, float] = {}  # lr of each step since the last check
        self.output_dir = output_dir

    def update(self, loss: torch.Tensor, step: int, lr: float) -> None:
        self.lrs.setdefault(step, lr)
        bad = ~torch.isfinite(loss.detach()) & (self.first == 0)
        self.first = torch.where(bad, torch.full_like(self.first, step), self.first)

    def check(self, accelerator, step: int, model: torch.nn.Module | None = None) -> None:
        """A collective: every rank calls it. With a model, also checks its weights are finite."""
        weights_ok = torch.ones((), device=self.first.device, dtype=torch.long)
        if model is not None:
            weights_ok = torch.stack([torch.isfinite(p.detach()).all() for p in model.parameters()]).all().long()
        found = accelerator.gather(torch.stack([self.first, weights_ok]).reshape(1, 2)).reshape(-1, 2).tolist()
        self.verdict([f for f, _ in found], all(ok for _, ok in found), step)

    def verdict(self, firsts: list[int], weights_ok: bool, step: int) -> None:
        """From every rank's first non-finite step (0: none) and the weights' state, gathered (the same on
        every rank): raise Diverged, or forget the lrs up to `step`."""
        firsts = [f for f in firsts if f > 0]
        if firsts:
            at = min(firsts)
            what = f"the training loss became non-finite at step {at} (lr {self.lrs.get(at, float('nan')):.4g})"
        elif not weights_ok:
            what = f"the weights became non-finite after step {step} (lr {self.lrs.get(step, float('nan')):.4g})"
        else:
            self.lrs = {s: lr for s, lr in self.lrs.items() if s > step}
            return
        kept = checkpoint_dirs(self.output_dir)
        raise Diverged(f"{what}: every rank stopped, nothing exported; "
                       + (f"newest finite checkpoint: {kept[-1]}" if kept else "no checkpoint was written")
                       + "; lower --lr (or set --clip_grad) and start again")
