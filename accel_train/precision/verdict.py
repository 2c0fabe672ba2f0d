"""The precision check's verdict (check.py): what one rank found, the ranks' verdicts combined, and
what a failed one says."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Verdict:
    precision: str
    limit: float  # the bound a parameter's error must stay under
    # the parameter with the largest error, and that error
    worst: tuple[str, float] = ("", 0.0)
    bad: dict[str, float] = field(default_factory=dict)  # parameter -> error, over the limit
    seconds: float = 0.0  # what the check cost on this machine
    # and its peak memory over what was in use before it, bytes
    memory: float = 0.0
    cached: bool = False
    error: str = ""  # the check itself failed (never cached)
    # "batch": each layer alone right, the errors rounding amplified (check.AMPLIFIED)
    cause: str = ""

    @property
    def ok(self) -> bool:
        return not self.bad

    def to_json(self) -> dict:
        return {
            "precision": self.precision,
            "limit": self.limit,
            "worst": list(self.worst),
            "bad": self.bad,
            "seconds": self.seconds,
            "cause": self.cause,
            "memory": self.memory,
        }

    @classmethod
    def from_json(cls, d: dict | None) -> Verdict | None:
        """A remembered verdict (cache.cached), or None if there is none or it cannot be read."""
        try:
            return (
                cls(
                    d["precision"],
                    float(d["limit"]),
                    tuple(d["worst"]),
                    dict(d["bad"]),
                    float(d["seconds"]),
                    cached=True,
                    cause=str(d.get("cause", "")),
                    memory=float(d.get("memory", 0.0)),
                )
                if d is not None
                else None
            )
        except (KeyError, TypeError, ValueError):
            return None


def combine(verdicts: list[Verdict]) -> Verdict:
    """Every rank's verdict -> one for all: a parameter that failed anywhere fails (its largest
    error)."""
    first = verdicts[0]
    bad: dict[str, float] = {}
    for v in verdicts:
        for n, e in v.bad.items():
            bad[n] = max(bad.get(n, 0.0), e)
    worst = max((v.worst for v in verdicts), key=lambda w: w[1])
    # (a wrong kernel on any rank: device)
    batch = bool(bad) and all(v.cause == "batch" for v in verdicts if v.bad)
    return Verdict(
        first.precision,
        max(v.limit for v in verdicts),
        worst,
        bad,
        max(v.seconds for v in verdicts),
        max(v.memory for v in verdicts),
        all(v.cached for v in verdicts),
        next((v.error for v in verdicts if v.error), ""),
        "batch" if batch else "",
    )


def describe(v: Verdict, limit_layers: int = 4) -> str:
    """'layer4.0.conv1.weight (error 1.6e+37), ...' for the failing parameters, worst first."""
    bad = sorted(v.bad.items(), key=lambda kv: -kv[1])
    text = ", ".join(f"{n} (error {e:.2g})" for n, e in bad[:limit_layers])
    return text + (f" and {len(bad) - limit_layers} more" if len(bad) > limit_layers else "")


def wrong_text(v: Verdict, name: str, batch: str, samples: int) -> str:
    """What a failed check says (`batch`: its shape, e.g. '8x3x8x8'): the device's kernel, or (each
    layer alone right, errors the size of rounding amplified) this batch."""
    if v.cause != "batch":
        return (
            f"{name} autocast computes wrong gradients on this device for {describe(v)} (a {batch}"
            f" batch; fp32 as the reference, bound {v.limit:.2g})"
        )
    return (
        f"{name} autocast's gradients on this {batch} batch differ from fp32's beyond rounding for"
        f" {describe(v)} (bound {v.limit:.2g}); each layer alone computes right on this device: the"
        " cause is the batch (few values per normalisation, e.g. 1x1 feature maps in a batch of"
        f" {samples}), not the device; a larger --batch_size or --image_size may train in {name}"
    )
