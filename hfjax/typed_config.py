"""Typed configuration from YAML: builds nested dataclasses from a YAML file or dict plus `a.b.c=value` command-line
overrides, checking every value against its field's type (int, float, bool, str, Literal, Optional/Union, list,
tuple, dict, nested dataclasses) and running each dataclass's `__post_init__`. A bad or unknown key fails with its
full dotted path, where it came from (the file or the overrides) and what was expected; an unknown key names the
closest known one. `to_dict` / `dump_yaml` save the resolved config. Generic: it defines no schema itself and
imports only PyYAML and the standard library."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

T = TypeVar("T")
OVERRIDES = "overrides"


class ConfigError(ValueError):
    """A config that does not match its dataclasses; the message has one line per problem."""


@dataclasses.dataclass
class _Origins:
    """Where values came from: the source's name and data (before overrides), and the paths the overrides set."""

    source: str
    source_data: dict[str, Any]
    overridden: set[str] = dataclasses.field(default_factory=set)

    def of(self, path: str) -> str:
        """Who set the value or section at `path`: the overrides (of it or of a section containing it), else the
        source and/or the overrides of keys inside it, else the defaults."""
        parts = re.sub(r"\[\d+\]", "", path).split(".") if path else []
        if any(".".join(parts[:i]) in self.overridden for i in range(1, len(parts) + 1)):
            return OVERRIDES
        node: Any = self.source_data
        for part in parts:
            node = node.get(part, dataclasses.MISSING) if isinstance(node, dict) else dataclasses.MISSING
        names = [self.source] if node is not dataclasses.MISSING else []
        if any(not path or p.startswith(path + ".") for p in self.overridden):
            names.append(OVERRIDES)
        return " + ".join(names) or "defaults"


def load_config(cls: type[T], source: str | Path | Mapping[str, Any] | None = None, overrides: Sequence[str] = ()) -> T:
    """An instance of dataclass `cls` from a YAML file path or a mapping (None: defaults only), with `key.path=value`
    overrides applied on top (values parsed as YAML: `x=3`, `x=[1,2]`, `x=null`). Raises `ConfigError`."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"load_config: expected a dataclass type, got {cls!r}")
    if source is None or isinstance(source, Mapping):
        name, data = ("the given mapping" if source is not None else "defaults"), copy.deepcopy(dict(source or {}))
    else:
        name, data = str(source), _read_yaml(Path(source))
    origins = _Origins(name, copy.deepcopy(data))
    for text in overrides:
        path, value = _parse_override(text)
        _set_path(data, path, value, origins)
        origins.overridden.add(path)
    return _build_dataclass(cls, data, "", origins)


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def _parse_override(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: expected key.path=value, e.g. actor.optim.lr=1e-6")
    try:
        return key, yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: the value is not valid YAML ({exc})") from exc


def _set_path(data: dict[str, Any], path: str, value: Any, origins: _Origins) -> None:
    node, parts = data, path.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            where = ".".join(parts[: i + 1])
            raise ConfigError(f"{where}: expected a mapping to set {path} in, got {child!r} (from {origins.of(where)})")
        node = child
    node[parts[-1]] = value


def _build_dataclass(cls: type[T], data: Any, path: str, origins: _Origins, base: Any = None) -> T:
    """An instance of `cls` from a mapping; keys it lacks keep `base`'s values (or the fields' defaults)."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(_problem(path, _describe(cls), data, origins))
    fields = {yaml_key(f.name): f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    problems, kwargs = [], {}
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(fields)}"
            problems.append(f"{_join(path, str(key))}: unknown key (from {origins.of(_join(path, str(key)))}){hint}")
    for name, field in fields.items():
        default = getattr(base, field.name) if base is not None else _default(field)
        if name in data:
            try:
                kwargs[field.name] = _convert(hints[field.name], data[name], _join(path, name), origins, default)
            except ConfigError as exc:
                problems.extend(str(exc).splitlines())
        elif default is dataclasses.MISSING:
            problems.append(f"{_join(path, name)}: missing required key (from {origins.of(path)})")
        elif base is not None:
            kwargs[field.name] = default
    if problems:
        raise ConfigError("\n".join(problems))
    try:
        return cls(**kwargs)
    except (ValueError, TypeError, ArithmeticError) as exc:
        raise ConfigError(_check_problem(cls, path, str(exc), origins)) from exc


def _check_problem(cls: type, path: str, message: str, origins: _Origins) -> str:
    """A `__post_init__` error as one problem per line, each naming the full dotted path: a line that starts with
    one of `cls`'s fields (`name: ...`, `name=...`, `name.key ...`, or the section's own name first, as in
    `optim.lr: ...` inside `actor.optim`) gets the section's path in front; any other line names the section."""
    fields = {yaml_key(f.name) for f in dataclasses.fields(cls)}
    section = path.rsplit(".", 1)[-1]
    lines = []
    for line in message.splitlines() or [message]:
        if section and line.startswith(section + "."):
            line = line[len(section) + 1 :]
        head = re.match(r"[A-Za-z_][A-Za-z0-9_]*", line)
        if head and head.group() in fields and line[head.end() : head.end() + 1] in (":", "=", ".", " ", "["):
            where = _join(path, re.split(r"[:= \[]", line, maxsplit=1)[0])
            lines.append(f"{_join(path, line)} (from {origins.of(where)})")
        else:
            lines.append(f"{path or cls.__name__}: {line} (from {origins.of(path)})")
    return "\n".join(lines)


def yaml_key(field_name: str) -> str:
    """The key of a dataclass field in YAML and overrides: its name without a trailing underscore (so a section can be
    called `async`, a Python keyword, through a field `async_`)."""
    return field_name[:-1] if field_name.endswith("_") else field_name


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def _convert(tp: Any, value: Any, path: str, origins: _Origins, default: Any = dataclasses.MISSING) -> Any:
    """`value` checked against type `tp`; a nested dataclass mapping updates the field's `default` instance."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return _build_dataclass(tp, value, path, origins, default if isinstance(default, tp) else None)
    if origin is Literal:
        if value in args and all(type(value) is type(a) for a in args if a == value):
            return value
        close = (
            difflib.get_close_matches(value, [a for a in args if isinstance(a, str)], n=1)
            if isinstance(value, str)
            else []
        )
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(_problem(path, f"one of {', '.join(map(repr, args))}", value, origins) + hint)
    if origin in (Union, types.UnionType):
        return _convert_union(args, value, path, origins)
    if origin in (list, tuple) or tp in (list, tuple):
        return _convert_sequence(tp, origin or tp, args, value, path, origins)
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(_problem(path, "a mapping", value, origins))
        key_tp, value_tp = args or (Any, Any)
        return {
            _convert(key_tp, k, path, origins): _convert(value_tp, v, _join(path, str(k)), origins)
            for k, v in value.items()
        }
    return _convert_scalar(tp, value, path, origins)


def _convert_union(args: tuple[Any, ...], value: Any, path: str, origins: _Origins) -> Any:
    nullable = type(None) in args
    if value is None and nullable:
        return None
    options = [a for a in args if a is not type(None)]
    for option in options:
        try:
            return _convert(option, value, path, origins)
        except ConfigError as exc:
            if len(options) == 1 and not str(exc).startswith(f"{path}: expected "):
                raise  # a problem inside the value (a nested key or an item): report it there
    expected = " or ".join(_describe(o) for o in options) + (" or null" if nullable else "")
    raise ConfigError(_problem(path, expected, value, origins))


def _convert_sequence(tp: Any, kind: type, args: tuple[Any, ...], value: Any, path: str, origins: _Origins) -> Any:
    if not isinstance(value, list | tuple):
        raise ConfigError(_problem(path, f"a list ({_describe(tp)})", value, origins))
    if kind is tuple and args and args[-1] is not Ellipsis:
        if len(value) != len(args):
            raise ConfigError(_problem(path, f"a list of {len(args)} items ({_describe(tp)})", value, origins))
        item_types = list(args)
    else:
        item_types = [args[0] if args else Any] * len(value)
    items = [_convert(t, v, f"{path}[{i}]", origins) for i, (t, v) in enumerate(zip(item_types, value, strict=True))]
    return tuple(items) if kind is tuple else items


def _convert_scalar(tp: Any, value: Any, path: str, origins: _Origins) -> Any:
    if tp is bool and isinstance(value, bool):
        return value
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp is float:
        number = _float_or_none(value)
        if number is not None:
            return number
    if tp is str and isinstance(value, str):
        return value
    if tp is Path and isinstance(value, str | Path):
        return Path(value)
    if tp not in (bool, int, float, str, Path):
        raise ConfigError(f"{path}: unsupported field type {_describe(tp)} in the config dataclass")
    nan = isinstance(value, float) and math.isnan(value)
    raise ConfigError(_problem(path, "a float that is not NaN" if nan else _describe(tp), value, origins))


def _float_or_none(value: Any) -> float | None:
    """A number or a numeric string (PyYAML reads 1e-5, without a dot, as a string) as a float; None for anything
    else, for NaN (never a setting: every comparison with it is false) and for ints beyond the float range."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    try:
        number = float(value)
    except (ValueError, OverflowError):
        return None
    return None if math.isnan(number) else number


_NAMES = {
    int: "an int",
    float: "a float",
    bool: "a bool (true/false)",
    str: "a string",
    Path: "a path string",
}


def _describe(tp: Any) -> str:
    if tp in _NAMES:
        return _NAMES[tp]
    if dataclasses.is_dataclass(tp):
        return f"a mapping of {tp.__name__} fields"
    name = getattr(tp, "__name__", None) if typing.get_origin(tp) is None else None
    return name or str(tp).replace("typing.", "")


def _problem(path: str, expected: str, value: Any, origins: _Origins) -> str:
    got = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    return f"{path or '<top level>'}: expected {expected}, got {got} (from {origins.of(path)})"


def check_fields(section: Any, **rules: tuple[Callable[[Any], bool], str]) -> None:
    """Raises ValueError `name: expected EXPECTED, got VALUE` for the first field of `section` whose value fails its
    rule `(predicate, expected)`, e.g. `check_fields(self, slots=AT_LEAST_1)`; `load_config` puts the section's
    path in front."""
    for name, (ok, expected) in rules.items():
        value = getattr(section, name)
        if not ok(value):
            raise ValueError(f"{name}: expected {expected}, got {value!r}")


def check_name(field: str, value: str, known: Sequence[str], kind: str) -> None:
    """Raises ValueError naming `field` when `value` is not one of the `known` names of a registry of `kind`
    (e.g. "policy loss"), with the closest known name."""
    if value in known:
        return
    close = difflib.get_close_matches(str(value), list(known), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"{field}: expected a registered {kind} ({', '.join(known)}), got {value!r}{hint}")


AT_LEAST_1 = (lambda v: v >= 1, ">= 1")
NON_NEGATIVE = (lambda v: v >= 0, ">= 0")
POSITIVE = (lambda v: v > 0, "> 0")
POSITIVE_OR_NULL = (lambda v: v is None or v > 0, "> 0 or null")
FRACTION = (lambda v: 0 <= v <= 1, "in [0, 1]")
ZERO_AT_END = (lambda v: v >= 0, ">= 0 (0: at the end only)")  # how often something happens


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def to_dict(cfg: Any) -> Any:
    """A dataclass config as plain YAML-safe data: dicts, lists (tuples become lists), scalars, paths as strings."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {yaml_key(f.name): to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, Mapping):
        return {k: to_dict(v) for k, v in cfg.items()}
    if isinstance(cfg, list | tuple):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, Path):
        return str(cfg)
    return cfg


def dump_yaml(cfg: Any, path: str | Path) -> Path:
    """Writes the resolved config as YAML (fields in declaration order), creating parent directories."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False)
    return path
