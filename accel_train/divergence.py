"""The non-finite watch: a loss or weights that became NaN/inf, or weights that jumped by orders of magnitude in one
step (finite but absurd: a kernel's garbage gradient, an lr far too high), stop every rank at the same step, without
a host sync per step, and nothing non-finite is exported or checkpointed (exit status 5)."""

from __future__ import annotations

import torch

from .errors import Diverged
from .files import checkpoint_dirs


class NonFiniteWatch:
    """Notes on the device, per micro-batch and without a host sync, the first step whose loss is not
    finite; `check` reads that back on every rank at a point where the ranks meet anyway and raises
    `Diverged` on all of them together."""

    JUMP = 1000.0  # a weight tensor whose norm grows over JUMP x its last step's norm and past an RMS of 1 jumped

    def __init__(self, device, output_dir, model: torch.nn.Module | None = None):
        self.first = torch.zeros((), device=device, dtype=torch.long)  # 0: every loss so far finite
        self.lrs: dict[int, float] = {}  # lr of each step since the last check
        self.output_dir = output_dir
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad] if model is not None else []
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        self.floor = torch.tensor([float(p.numel()) ** 0.5 for p in self.params], device=device)  # RMS 1
        self.norms = self._norms()
        self.jumped = torch.zeros((), device=device, dtype=torch.long)  # 0: no jump so far; else its step
        self.jump = torch.zeros(3, device=device, dtype=torch.float64)  # (parameter index, norm before, after)

    def update(self, loss: torch.Tensor, step: int, lr: float) -> None:
        self.lrs.setdefault(step, lr)
        bad = ~torch.isfinite(loss.detach()) & (self.first == 0)
        self.first = torch.where(bad, torch.full_like(self.first, step), self.first)

    def _norms(self) -> torch.Tensor | None:
        with torch.no_grad():
            return torch.stack([p.detach().float().norm() for p in self.params]) if self.params else None

    def update_weights(self, step: int) -> None:
        """After optimizer step `step`: note on the device (no host sync) the first step at which a weight tensor's
        norm jumped by orders of magnitude."""
        if self.norms is None:
            return
        norms = self._norms()
        over = torch.isfinite(norms) & (norms > self.JUMP * self.norms + self.floor)  # (non-finite: checked as such)
        i = torch.argmax((norms / (self.norms + self.floor)) * over)
        new = over.any() & (self.jumped == 0)
        self.jumped = torch.where(new, torch.full_like(self.jumped, step), self.jumped)
        self.jump = torch.where(new, torch.stack([i.double(), self.norms[i].double(), norms[i].double()]), self.jump)
        self.norms = norms

    def check(self, accelerator, step: int, model: torch.nn.Module | None = None) -> None:
        """A collective: every rank calls it. With a model, also checks its weights are finite."""
        weights_ok = torch.ones((), device=self.first.device, dtype=torch.long)
        if model is not None:
            weights_ok = torch.stack([torch.isfinite(p.detach()).all() for p in model.parameters()]).all().long()
        found = accelerator.gather(torch.stack([self.first, weights_ok, self.jumped]).reshape(1, 3)).reshape(-1, 3)
        found = found.tolist()
        self.verdict([f for f, _, _ in found], all(ok for _, ok, _ in found), step, [j for _, _, j in found])

    def verdict(self, firsts: list[int], weights_ok: bool, step: int, jumps: list[int] = ()) -> None:
        """From every rank's first non-finite step (0: none), the weights' state and the first weight jump (0:
        none), gathered (the same on every rank): raise Diverged, or forget the lrs before `step`."""
        firsts, jumps = [f for f in firsts if f > 0], [j for j in jumps if j > 0]
        if firsts and not (jumps and min(jumps) < min(firsts)):
            at = min(firsts)
            what = f"the training loss became non-finite at step {at} (lr {self.lr(at)})"
        elif jumps:
            at = min(jumps)
            i, before, after = self.jump.tolist() if int(self.jumped) == at else (-1, 0.0, 0.0)
            name = self.names[int(i)] if i >= 0 else "a parameter (on another rank)"
            what = f"the weights of {name} jumped from norm {before:.3g} to {after:.3g} at step {at} (lr {self.lr(at)})"
        elif not weights_ok:
            what = f"the weights became non-finite after step {step} (lr {self.lr(step)})"
        else:
            self.lrs = {s: lr for s, lr in self.lrs.items() if s >= step}
            return
        kept = checkpoint_dirs(self.output_dir)
        raise Diverged(f"{what}: every rank stopped, nothing exported; "
                       + (f"newest finite checkpoint: {kept[-1]}" if kept else "no checkpoint was written")
                       + "; lower --lr (or set --clip_grad) and start again")

    def lr(self, step: int) -> str:
        return f"{self.lrs[step]:.4g}" if step in self.lrs else "unknown"
