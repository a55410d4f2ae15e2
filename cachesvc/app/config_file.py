"""Config files (YAML or JSON) onto the frozen config dataclasses, field by field.

A file's keys are the dataclass's field names, nested as the dataclasses nest: a field whose type
is a dataclass is a mapping. Nothing here knows the fields: new fields work as soon as they are
declared. A key that is not a field, or a value of the wrong type, is a `ConfigError` naming
its path (`engine.blok_size`) and the file; the dataclass's own validation then runs as usual.
This is what the Helm chart's ConfigMap feeds to `cachesvc serve --config`.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import json
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from cachesvc.kv.config import ConfigError

T = TypeVar("T")


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping in a .json, .yaml or .yml file (an empty YAML file is {}); reads only."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"config file {path} is not valid JSON: {exc}") from None
    else:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping, not {type(data).__name__}")
    return data


def load_config_file(path: str | Path, cls: type[T]) -> T:
    """`cls` built from the file at `path`; a ConfigError names the file and the bad key."""
    try:
        return from_mapping(cls, read_config_file(path))
    except ConfigError as exc:
        if str(path) in str(exc):
            raise
        raise ConfigError(f"{path}: {exc}") from None


def from_mapping(cls: type[T], data: Mapping[str, Any], where: str = "") -> T:
    """An instance of the dataclass `cls` from `data`; missing keys take the defaults."""
    assert dataclasses.is_dataclass(cls), cls
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [key for key in data if key not in fields]
    if unknown:
        key = str(unknown[0])
        close = difflib.get_close_matches(key, list(fields), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(fields)}"
        raise ConfigError(f"unknown key {where + key!r}: {cls.__name__} has no such field{hint}")
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for name, field in fields.items():
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], where + name)
        elif _has_no_default(field) and _is_dataclass_type(hints[name]):
            kwargs[name] = from_mapping(hints[name], {}, f"{where}{name}.")
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise ConfigError(f"{where.rstrip('.') or cls.__name__}: {exc}") from None
    except TypeError as exc:  # a field without a default that the file does not set
        raise ConfigError(f"{where.rstrip('.') or cls.__name__}: {exc}") from None


def with_overrides(config: T, overrides: Mapping[str, Any]) -> T:
    """A copy of `config` with dotted paths replaced, e.g. {"router.port": 6000}; validates.

    The fields of one dataclass are replaced at once, so fields that are only valid together
    (a TLS certificate and its key) are checked together."""
    replaced: T = _replace_paths(config, overrides)
    return replaced


def changed_fields(config: Any, baseline: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted paths and values of the fields where `config` differs from `baseline`, an instance
    of the same dataclass: with_overrides(x, changed_fields(config, baseline)) carries them over."""
    changed: dict[str, Any] = {}
    for field in dataclasses.fields(config):
        value, base = getattr(config, field.name), getattr(baseline, field.name)
        if dataclasses.is_dataclass(value) and type(value) is type(base):
            changed.update(changed_fields(value, base, f"{prefix}{field.name}."))
        elif value != base:
            changed[prefix + field.name] = value
    return changed


def _replace_paths(config: Any, overrides: Mapping[str, Any]) -> Any:
    direct: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for path, value in overrides.items():
        head, _, rest = path.partition(".")
        if not any(f.name == head for f in dataclasses.fields(config)):
            raise ConfigError(f"{type(config).__name__} has no field {head!r}")
        if rest:
            nested.setdefault(head, {})[rest] = value
        else:
            direct[head] = value
    for head, inner in nested.items():
        direct[head] = _replace_paths(direct.get(head, getattr(config, head)), inner)
    return dataclasses.replace(config, **direct) if direct else config


def _has_no_default(field: dataclasses.Field[Any]) -> bool:
    return field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _convert(tp: Any, value: Any, where: str) -> Any:
    """`value` checked against the annotation `tp` (and converted where a file cannot say it:
    list -> tuple, str -> Path or enum, int -> float)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        return _convert_union(args, value, where)
    if value is None:
        raise ConfigError(f"{where} must not be null")
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{where} must be one of {list(args)}, got {value!r}")
        return value
    if _is_dataclass_type(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where} must be a mapping of {tp.__name__} fields, got {value!r}")
        return from_mapping(tp, value, where + ".")
    if origin in (tuple, list, frozenset, set):
        return _convert_sequence(origin, args, value, where)
    if origin in (dict, Mapping) or tp in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where} must be a mapping, got {value!r}")
        key_tp, value_tp = args or (Any, Any)
        return {
            _convert(key_tp, k, f"{where}.{k}"): _convert(value_tp, v, f"{where}.{k}")
            for k, v in value.items()
        }
    return _convert_scalar(tp, value, where)


def _convert_union(args: tuple[Any, ...], value: Any, where: str) -> Any:
    if value is None:
        if type(None) in args:
            return None
        raise ConfigError(f"{where} must not be null")
    errors = []
    for arg in args:
        if arg is type(None):
            continue
        try:
            return _convert(arg, value, where)
        except ConfigError as exc:
            errors.append(str(exc))
    raise ConfigError(" or ".join(errors))


def _convert_sequence(origin: Any, args: tuple[Any, ...], value: Any, where: str) -> Any:
    if not isinstance(value, list | tuple):
        raise ConfigError(f"{where} must be a list, got {value!r}")
    if origin is tuple and args and args[-1] is not Ellipsis:
        if len(args) != len(value):
            raise ConfigError(f"{where} must have {len(args)} items, got {len(value)}")
        return tuple(
            _convert(a, v, f"{where}[{i}]")
            for i, (a, v) in enumerate(zip(args, value, strict=True))
        )
    item_tp = args[0] if args else Any
    items = [_convert(item_tp, v, f"{where}[{i}]") for i, v in enumerate(value)]
    return origin(items)


def _convert_scalar(tp: Any, value: Any, where: str) -> Any:
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            names = [m.value for m in tp]
            raise ConfigError(f"{where} must be one of {names}, got {value!r}") from None
    # bool is an int in Python, but `true` for a count or a size is a mistake in a file.
    is_bool = isinstance(value, bool)
    if tp is float and isinstance(value, int | float) and not is_bool:
        return float(value)
    if tp is Path and isinstance(value, str):
        return Path(value)
    if isinstance(tp, type) and isinstance(value, tp) and (tp is bool or not is_bool):
        return value
    name = getattr(tp, "__name__", str(tp))
    raise ConfigError(f"{where} must be {_ARTICLE.get(name, name)}, got {value!r}")


_ARTICLE = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}
