"""The non-finite watch: a loss or weights that became NaN/inf, or weights that jumped by orders of
magnitude in one step (finite but absurd: a kernel's garbage gradient, an lr far too high), stop
every rank at the same step, without a host sync per step, and nothing non-finite is exported or
checkpointed (exit status 5)."""

from __future__ import annotations

import torch

from ..errors import Diverged, of_step
from ..files import checkpoint_dirs


class NonFiniteWatch:
    """Notes on the device, per micro-batch and without a host sync, the first step whose loss is
    not finite; `check` reads that back on every rank at a point where the ranks meet anyway and
    raises `Diverged` on all of them together."""

    # a weight tensor whose norm grows over JUMP x its last step's norm and past an RMS of 1 jumped
    JUMP = 1000.0
    # a total gradient norm over this x the weights' total norm is no training signal
    GRAD_ABSURD = 1e6

    def __init__(
        self, device, output_dir, model: torch.nn.Module | None = None, precision: str = "no"
    ):
        # the run's autocast precision: a jump under bf16/fp16 may be a kernel's
        self.precision = precision
        self.first = torch.zeros((), device=device, dtype=torch.long)  # 0: every loss so far finite
        self.lrs: dict[int, float] = {}  # lr of each step since the last check
        self.output_dir = output_dir
        named = (
            [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            if model is not None
            else []
        )
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        # each tensor's norm at an RMS of 1
        self.floor = torch.tensor([float(p.numel()) ** 0.5 for p in self.params], device=device)
        self.norms = self._norms()
        # 0: no jump so far; else its step
        self.jumped = torch.zeros((), device=device, dtype=torch.long)
        # (parameter index, norm before, after)
        self.jump = torch.zeros(3, device=device, dtype=torch.float64)
        # the last step's gradient norm (with --clip_grad)
        self.grad_norm = torch.zeros((), device=device, dtype=torch.float64)

    def update(self, loss: torch.Tensor, step: int, lr: float) -> None:
        self.lrs.setdefault(step, lr)
        bad = ~torch.isfinite(loss.detach()) & (self.first == 0)
        self.first = torch.where(bad, torch.full_like(self.first, step), self.first)

    def _norms(self) -> torch.Tensor | None:
        # (one foreach kernel per dtype, as clip_grad_norm_ computes its norms)
        with torch.no_grad():
            return (
                torch.stack(torch._foreach_norm([p.detach() for p in self.params])).float()
                if self.params
                else None
            )

    def update_weights(self, step: int, grad_norm: torch.Tensor | None = None) -> None:
        """After optimizer step `step`: note on the device (no host sync) the first step at which a
        weight tensor's norm jumped by orders of magnitude, or (with --clip_grad, whose total
        gradient norm is passed) the gradient's norm did, or stood over GRAD_ABSURD x the weights'
        (a clipped garbage gradient leaves the weights sane)."""
        if self.norms is None:
            return
        norms = self._norms()
        # (a non-finite norm is checked as such, not as a jump)
        over = torch.isfinite(norms) & (norms > self.JUMP * self.norms + self.floor)
        i = torch.argmax((norms / (self.norms + self.floor)) * over)
        found = torch.stack([i.double(), self.norms[i].double(), norms[i].double()])
        if grad_norm is not None:  # index -2: the gradient
            g = grad_norm.detach().double().reshape(())
            absurd = torch.isfinite(g) & (
                (g > self.JUMP * self.grad_norm) & (self.grad_norm > 0)
                | (g > self.GRAD_ABSURD * norms.double().norm())
            )
            found = torch.where(
                over.any(), found, torch.stack([torch.full_like(g, -2), self.grad_norm, g])
            )
            over = over.any() | absurd
            self.grad_norm = g
        new = over.any() & (self.jumped == 0)
        self.jumped = torch.where(new, torch.full_like(self.jumped, step), self.jumped)
        self.jump = torch.where(new, found, self.jump)
        self.norms = norms

    def check(self, accelerator, step: int, model: torch.nn.Module | None = None) -> None:
        """A collective: every rank calls it. With a model, also checks its weights are finite."""
        state = torch.ones((), device=self.first.device, dtype=torch.long)
        if model is not None:
            state = weights_state(model)
        mine = torch.stack(
            [self.first, state, self.jumped, torch.full_like(self.jumped, step)]
        ).reshape(1, 4)
        found = of_step(
            accelerator.gather(mine).reshape(-1, 4).tolist(), step, "the divergence check"
        )
        states = [s for _, s, _, _ in found]
        overflowed = next((s - 2 for s in states if s >= 2), -1) if 0 not in states else -1
        # (the user's names, not those of what prepare() wrapped)
        names = (
            [
                n.removeprefix("_orig_mod.").removeprefix("module.")
                for n, _ in model.named_parameters()
            ]
            if model is not None
            else []
        )
        self.verdict(
            [f for f, _, _, _ in found],
            all(s == 1 for s in states),
            step,
            [j for _, _, j, _ in found],
            names[int(overflowed)] if overflowed >= 0 else "",
        )

    def verdict(
        self,
        firsts: list[int],
        weights_ok: bool,
        step: int,
        jumps: list[int] = (),
        overflowed: str = "",
    ) -> None:
        """From every rank's first non-finite step (0: none), the weights' state and the first
        weight jump (0: none), gathered (the same on every rank): raise Diverged, or forget the lrs
        before `step`. `overflowed`: a parameter whose elements are finite but whose norm is not
        (weights not ok for that reason alone)."""
        firsts, jumps = [f for f in firsts if f > 0], [j for j in jumps if j > 0]
        if firsts and not (jumps and min(jumps) < min(firsts)):
            at = min(firsts)
            what = f"the training loss became non-finite at step {at} (lr {self.lr(at)})"
        elif jumps:
            at = min(jumps)
            i, before, after = self.jump.tolist() if int(self.jumped) == at else (-1, 0.0, 0.0)
            name = "the weights of " + (
                self.names[int(i)] if i >= 0 else "a parameter (on another rank)"
            )
            name = "the gradient (before --clip_grad)" if i == -2 else name
            what = (
                f"{name} jumped from norm {before:.3g} to {after:.3g} at step {at} "
                f"(lr {self.lr(at)})" + self.kernel_note()
            )
        elif not weights_ok and overflowed:
            what = (
                f"the weights of {overflowed} became absurd after step {step} "
                f"(lr {self.lr(step)}): finite, but their norm overflows" + self.kernel_note()
            )
        elif not weights_ok:
            what = f"the weights became non-finite after step {step} (lr {self.lr(step)})"
        else:
            self.lrs = {s: lr for s, lr in self.lrs.items() if s >= step}
            return
        kept = checkpoint_dirs(self.output_dir)
        raise Diverged(
            f"{what}: every rank stopped, nothing exported; "
            + (f"newest finite checkpoint: {kept[-1]}" if kept else "no checkpoint was written")
            + "; lower --lr (or set --clip_grad) and start again"
        )

    def kernel_note(self) -> str:
        return (
            f"; a wrong {self.precision} kernel does this too (--mixed_precision no rules it out)"
            if self.precision != "no"
            else ""
        )

    def lr(self, step: int) -> str:
        return f"{self.lrs[step]:.4g}" if step in self.lrs else "unknown"


def weights_state(model: torch.nn.Module) -> torch.Tensor:
    """On the device, no host sync: 1 when every weight tensor's norm is finite; 0 when an element
    is not finite; 2 + i when parameter i's elements are finite but its fp32 norm overflows (an
    element near 1e19 or more: absurd, e.g. a wrong kernel's garbage of 1e32, which a
    finite-elements test alone let through to the export)."""
    params = [p.detach() for p in model.parameters()]
    with torch.no_grad():
        norms_ok = torch.stack(
            [torch.isfinite(n) for n in torch._foreach_norm([p.float() for p in params])]
        )
        elements_ok = torch.stack([torch.isfinite(p).all() for p in params]).all()
    first_bad = torch.argmin(norms_ok.long())
    return torch.where(
        norms_ok.all(),
        torch.ones_like(first_bad),
        torch.where(elements_ok, first_bad + 2, torch.zeros_like(first_bad)),
    )
