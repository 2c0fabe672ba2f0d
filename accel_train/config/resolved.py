"""What start-up decided, beside what was asked: `Resolved` (the values the run trains with where
a setting was automatic, or taken from the resumed run, or chosen for this data and machine), the
run's settings built from both (a new TrainConfig: the asked one is never written), what the
command line took from a resumed run's record (`Taken`), and config.yaml, which records both.

config.yaml, format 2: the run's settings as it trained at the top level (`accel-train --config
config.yaml` replays the run, and a resume takes the run's own settings from it), `format: 2`, and
`asked:` the settings as asked where start-up decided another value. A file without `format` is
one written before the format had a number (the run's settings alone) and reads the same.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import yaml

from ..errors import ConfigError

FORMAT = 2  # config.yaml's format: the run's settings, and `asked:`
# what start-up decides where the asked value is automatic (or a resumed run's differs)
RESOLVED = (
    "image_size",
    "stem",
    "mean",
    "std",
    "pipeline",
    "train_crop",
    "crop_pct",
    "batch_size",
    "num_workers",
    "mixed_precision",
    "channels_last",
    "model",
    "model_kwargs",
)
# config.yaml's own keys beside the settings
FORMAT_KEY, ASKED_KEY = "format", "asked"


@dataclass(frozen=True)
class Taken:
    """What the command line took from the record of the run a --resume continues
    (changes.run_settings): the line that says it, and the settings (None: no record was read on
    this machine; the ranks then share another machine's, resume.decide)."""

    said: str | None = None
    settings: dict | None = None


NOTHING_TAKEN = Taken()  # a fresh run, or train(): no record read


@dataclass(frozen=True)
class Resolved:
    """What start-up decided, built once at its end (training/startup.py) and carried by the run:
    the values it trains with, what was asked where start-up decided another value (an automatic
    default, a resumed run's own setting), and the line said at start about what the command line
    took from the run's record."""

    image_size: int
    stem: str
    mean: str | None
    std: str | None
    pipeline: str
    train_crop: str
    crop_pct: float | None
    batch_size: int
    num_workers: int | None
    mixed_precision: str
    channels_last: bool
    model: str
    model_kwargs: str | None
    asked: dict = field(default_factory=dict)  # {setting: as asked} where the run's differs
    notes: tuple[str, ...] = ()

    @classmethod
    def of(cls, settings, asked, notes=()) -> Resolved:
        """The record of the run's `settings` (with_values' result at the end of start-up) beside
        the `asked` config."""
        return cls(
            **{name: getattr(settings, name) for name in RESOLVED},
            asked={
                f.name: getattr(asked, f.name)
                for f in dataclasses.fields(asked)
                if getattr(asked, f.name) != getattr(settings, f.name)
            },
            notes=tuple(notes),
        )


def with_values(config, values: dict):
    """A new config: `config` with `values` in place (validated again); `config` stays as it is."""
    return dataclasses.replace(config, **values) if values else config


def write_yaml(path, settings, asked: dict | None = None, **recorded) -> None:
    """config.yaml: the run's `settings` (`recorded`: values in place of theirs), and what was
    `asked` ({setting: as asked}) where it differs. Never trust_model_code: a file does not grant it
    (cli.py)."""
    from ..files import open_output

    values = {**settings.to_dict(), **recorded}
    values.pop("trust_model_code", None)
    changed = {k: v for k, v in (asked or {}).items() if k in values and v != values[k]}
    with open_output(path) as f:
        f.write(
            f"# accel_train configuration, format {FORMAT}: the run's settings as it trained "
            "(`accel-train --config config.yaml` replays it); asked: the values asked where "
            "start-up decided another\n"
        )
        yaml.safe_dump({FORMAT_KEY: FORMAT, **values, ASKED_KEY: changed}, f, sort_keys=False)


def read_yaml(values: dict, path) -> tuple[dict, dict]:
    """A config.yaml's mapping -> (the run's settings, what was asked where start-up decided
    another). Every format so far reads; a newer one is refused in one line."""
    values = dict(values)
    version = values.pop(FORMAT_KEY, 1)
    asked = values.pop(ASKED_KEY, None) if version >= 2 else None
    if not isinstance(version, int) or version > FORMAT:
        raise ConfigError(
            f"--config {path}: format {version!r} is written by a newer accel_train (this one "
            f"reads up to {FORMAT}); upgrade accel_train, or remove the format key to read it as "
            "plain settings"
        )
    if asked is not None and not isinstance(asked, dict):
        raise ConfigError(f"--config {path}: asked must be a mapping of option: value")
    return values, asked or {}
