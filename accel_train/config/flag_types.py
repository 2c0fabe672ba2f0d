"""The checks argparse makes for a flag's value (its type, a finite number, its choices), made for
every value of a TrainConfig, so that a --config YAML and train()'s config get them too."""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing

from ..errors import ConfigError


def check_types_and_choices(cfg) -> None:
    """The checks argparse makes for flags, made here so that --config YAML gets them too."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value, kind = getattr(cfg, f.name), base_type(hints[f.name])
        if value is None and optional(hints[f.name]):
            continue
        if kind is bool:
            ok = isinstance(value, bool)
        elif kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        else:
            ok = isinstance(value, kind)
        if not ok:
            raise ConfigError(
                f"--{f.name} must be "
                f"{'true or false' if kind is bool else 'a ' + kind.__name__}, "
                f"got {value!r}"
            )
        if kind is float and not math.isfinite(value):
            raise ConfigError(f"--{f.name} must be a finite number, got {value}")
        choices = f.metadata.get("choices")
        if choices and value not in choices:
            raise ConfigError(
                f"--{f.name} {value!r}: invalid choice; pick one of {', '.join(choices)}"
            )


def optional(tp) -> bool:
    return type(None) in typing.get_args(tp)


def base_type(tp):
    """int | None -> int; bool -> bool."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return (
        args[0] if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union else tp
    )


def json_kwargs(cfg, name: str) -> dict:
    """A JSON-object flag (--model_kwargs, --sched_kwargs) as a dict; {} when not given."""
    if not getattr(cfg, name):
        return {}
    try:
        value = json.loads(getattr(cfg, name))
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"--{name} is not valid JSON ({e.msg}); write it like '{{\"drop_rate\": 0.1}}'"
        ) from None
    if not isinstance(value, dict):
        raise ConfigError(f"--{name} must be a JSON object, like '{{\"drop_rate\": 0.1}}'")
    return value


def at_least(cfg, low: float, *names: str) -> None:
    """Each named value (unset: None, passes) is >= low: one line naming the flag."""
    for name in names:
        value = getattr(cfg, name)
        if value is not None and not value >= low:
            raise ConfigError(f"--{name} must be >= {low:g}, got {value}")


def rgb(cfg, name: str, low: float) -> tuple[float, ...] | None:
    """--mean/--std: three numbers in [low, 1], 'R,G,B' from a flag or a list in a --config YAML;
    None if unset."""
    text = getattr(cfg, name)
    if text is None:
        return None
    try:
        values = tuple(
            float(v) for v in (text if isinstance(text, (list, tuple)) else str(text).split(","))
        )
    except (TypeError, ValueError):
        values = ()
    if len(values) != 3 or not all(low <= v <= 1 for v in values):
        raise ConfigError(
            f"--{name} must be three numbers in [{low:g}, 1] like 0.5,0.5,0.5; got {text!r}"
        )
    return values
