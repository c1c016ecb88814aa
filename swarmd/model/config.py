"""Typed config tables: a frozen dataclass read from a TOML/msgpack table, every error naming its key.

Job specs and architecture configs are both plain dataclasses; reading them through one function keeps
the rules identical everywhere: unknown keys are errors (a typo must not silently fall back to a
default), ints are not bools, ints widen to floats so the canonical form of `lr = 1` and `lr = 1.0`
is the same, and tuples round-trip through lists because TOML and msgpack have no tuples.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, TypeVar

from swarmd.errors import ConfigError

T = TypeVar("T")


def parse_table(cls: type[T], raw: Any, prefix: str = "") -> T:
    """Build dataclass `cls` from a mapping, checking keys and types; raises `ConfigError`."""
    if not isinstance(raw, Mapping):
        raise ConfigError(prefix or "<root>", f"must be a table, got {_type_name(raw)}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [key for key in raw if key not in fields]
    if unknown:
        raise ConfigError(_join(prefix, str(unknown[0])), f"unknown key (known: {', '.join(fields)})")
    hints = typing.get_type_hints(cls)
    values = {}
    for name, field in fields.items():
        key = _join(prefix, name)
        if name in raw:
            values[name] = parse_value(raw[name], hints[name], key)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError(key, "is required")
    try:
        return cls(**values)
    except ConfigError as exc:
        raise exc.under(prefix) from None


def table_to_dict(obj: Any) -> Any:
    """The plain (msgpack/TOML-able) form of a config dataclass: tuples become lists, keys sorted."""
    if dataclasses.is_dataclass(obj):
        obj = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {k: table_to_dict(obj[k]) for k in sorted(obj)}
    if isinstance(obj, (list, tuple)):
        return [table_to_dict(v) for v in obj]
    return obj


def parse_value(value: Any, hint: Any, key: str) -> Any:
    """Check one value against a type hint (str, int, float, bool, Literal, tuple, optional, or a
    config dataclass for a nested table) and return it in canonical form; raises `ConfigError`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return parse_value(value, inner, key)
    if origin is Literal:
        if value not in args:
            raise ConfigError(key, f"must be one of {', '.join(map(repr, args))}, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(key, f"must be a list, got {_type_name(value)}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(parse_value(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(key, f"must have {len(args)} items, got {len(value)}")
        return tuple(parse_value(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if dataclasses.is_dataclass(hint):
        return parse_table(hint, value, key)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"must be true or false, got {_type_name(value)}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"must be an integer, got {_type_name(value)}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, f"must be a number, got {_type_name(value)}")
        try:
            return float(value)
        except OverflowError:  # an integer past a float's range (~1.8e308)
            raise ConfigError(key, "is too large for a number") from None
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(key, f"must be a string, got {_type_name(value)}")
        return value
    raise TypeError(f"config field {key} has unsupported type {hint!r}")


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _type_name(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a table"}.get(type(value), type(value).__name__)
