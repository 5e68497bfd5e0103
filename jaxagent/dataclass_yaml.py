"""Typed configs: dataclasses filled from YAML plus dotted ``key=value`` overrides.

A config is a tree of (frozen) dataclasses. :func:`load_config` reads a YAML file,
applies command-line overrides such as ``algo.clip_high=0.28`` or
``env.name=sokoban``, and builds the tree, checking every key and value on the way:

- an unknown key is an error that names its full dotted path, lists the valid keys
  of that section and suggests the closest one;
- a key that moved to another section (listed in the dataclass's ``MOVED_KEYS``
  class variable: old key -> new dotted key) is an error that names the new key, and
  one replaced by another way of saying it (``REPLACED_KEYS``: old key -> what to set)
  an error that says what to set, and one removed (``REMOVED_KEYS``: old key -> why) an
  error that says why;
- a value of the wrong type is an error that names the key, the expected type and
  the value given (``int`` is accepted where ``float`` is expected, nothing else is
  converted silently);
- a missing required field (a dataclass field without a default) is an error;
- a dataclass's own ``__post_init__`` checks run, and their errors are prefixed
  with the section's path.

Simple bounds of a numeric field are declared in its type and checked on construction
(:class:`Bound`, :class:`Bounded`): ``epochs: Annotated[int, Bound(ge=1)] = 1`` refuses
``epochs=0`` with ``epochs must be an int >= 1, got 0``; ``__post_init__`` is left with
the rules that relate several fields.

Override values are parsed by the type of the field they set, so ``lr=1e-5`` is a
float, ``use_lora=false`` a bool, ``stop=[a, b]`` a list (YAML flow syntax) and
``name=null`` None where the field is optional.

Supported field types: ``int``, ``float``, ``bool``, ``str``, ``typing.Literal``,
``X | None``, ``tuple[X, ...]``, ``tuple[X, Y]``, ``list[X]``, ``dict[str, X]``,
``typing.Any`` and nested dataclasses; any of them ``typing.Annotated`` (the loader
reads the type, :func:`check_bounds` the :class:`Bound`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A config file or override that cannot be turned into the typed config."""


# ---------------------------------------------------------------- bounds


@dataclasses.dataclass(frozen=True)
class Bound:
    """The bounds of a numeric field, declared in its type: ``Annotated[int, Bound(ge=1)]``,
    ``Annotated[float | None, Bound(gt=0)]`` (None passes), ``Annotated[float, Bound(ge=0, le=1)]``,
    ``Annotated[float, Bound()]`` (any finite number). An ``int`` field takes ints, a
    ``float`` field ints and finite floats; bools are neither. `unit` names what the
    number counts in the error ("seconds": "a finite number of seconds > 0")."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    unit: str | None = None

    def describe(self, kind: type, nullable: bool = False) -> str:
        """What the field takes: "an int >= 1", "a number in [0, 1]", "a finite number > 0 or null"."""
        low = f"[{self.ge}" if self.ge is not None else f"({self.gt}" if self.gt is not None else None
        high = f"{self.le}]" if self.le is not None else f"{self.lt})" if self.lt is not None else None
        if low and high:
            text = f"in {low}, {high}"
        else:
            limits = ((">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt))
            text = " ".join(f"{op} {v}" for op, v in limits if v is not None)
        unit = f" of {self.unit}" if self.unit else ""
        # a number bounded on both sides is finite; one bounded on one side must also be
        what = f"an int{unit}" if kind is int else f"a number{unit}" if low and high else f"a finite number{unit}"
        return " ".join(x for x in (what, text, "or null" if nullable else "") if x)

    def holds(self, value, kind: type) -> bool:
        """`value` is a `kind` (int, or float: int or finite float; never bool) within the bounds."""
        if isinstance(value, bool) or not isinstance(value, int if kind is int else (int, float)):
            return False
        if kind is not int and not math.isfinite(value):
            return False
        return (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )


@functools.cache
def declared_bounds(cls) -> tuple[tuple[str, Bound, type, bool], ...]:
    """`(field, bound, int or float, None allowed)` of each field of the dataclass `cls`
    whose type is ``Annotated[..., Bound(...)]``."""
    hints = typing.get_type_hints(cls, include_extras=True)
    out = []
    for f in dataclasses.fields(cls):
        tp = hints.get(f.name)
        if typing.get_origin(tp) is not typing.Annotated:
            continue
        base, *extras = typing.get_args(tp)
        for bound in (x for x in extras if isinstance(x, Bound)):
            kind = _strip_optional(base)
            if kind not in (int, float):
                raise TypeError(f"{cls.__name__}.{f.name}: a Bound needs an int or float field, not {_type_name(base)}")
            out.append((f.name, bound, kind, kind is not base))
    return tuple(out)


def check_bounds(obj) -> None:
    """`ValueError` naming the first field of the dataclass instance `obj` outside its
    declared `Bound`, and the bound: "epochs must be an int >= 1, got 0"."""
    for name, bound, kind, nullable in declared_bounds(type(obj)):
        value = getattr(obj, name)
        if not (value is None and nullable) and not bound.holds(value, kind):
            raise ValueError(f"{name} must be {bound.describe(kind, nullable)}, got {value!r}")


class Bounded:
    """Base of a config dataclass whose fields declare `Bound`s: its ``__post_init__``
    checks them (`check_bounds`). A subclass with rules of its own (between fields, or
    a value's form) defines ``__post_init__`` calling ``super().__post_init__()`` first."""

    def __post_init__(self):
        check_bounds(self)


def field_values(obj, cls) -> dict[str, Any]:
    """The fields of the dataclass instance `obj` that the dataclass `cls` also has, by
    name: the keyword arguments that build a `cls` from a section that declares them."""
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.name in names}


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2 numbers and duplicate keys as errors.

    PyYAML follows YAML 1.1, where ``1e-4`` (no dot, no exponent sign) is a string; YAML 1.2's
    core schema, and every other config tool, reads it as a float. A key written twice in one
    mapping would silently keep the last value; here it is an error naming the key and lines.
    """


_Loader.yaml_implicit_resolvers = {
    k: [r for r in v if r[0] != "tag:yaml.org,2002:float"] for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                   |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                   |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                   |[-+]?\.(?:inf|Inf|INF)
                   |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _mapping_without_duplicates(loader, node, deep=False):
    seen: dict = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            hash(key)
        except TypeError:
            continue  # the base constructor reports unhashable keys
        if key in seen:
            first = seen[key].start_mark.line + 1
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first set on line {first})", key_node.start_mark
            )
        seen[key] = key_node
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def safe_load(text: str):
    """``yaml.safe_load`` with YAML 1.2 floats and duplicate keys rejected (see `_Loader`)."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def load_config(cls, path: str | Path | None = None, overrides: Iterable[str] = (), *, saved: bool = False):
    """Build ``cls`` from the YAML file at ``path`` (optional) and ``key=value`` overrides.

    saved: the file is one a run wrote (its ``config.yaml``): keys that have moved since
      (``MOVED_KEYS``) are read at their new place and removed ones (``REMOVED_KEYS``)
      dropped, so an older run directory still resumes, evaluates and plots; in a config
      a person writes they are refused.
    """
    data: dict = {}
    if path is not None:
        data = read_yaml(path)
        if saved:
            _relocate_moved(cls, data, data)
    for item in overrides:
        key, value = _split_override(item)
        _set_dotted(cls, data, key, value)
    return from_dict(cls, data)


def _relocate_moved(cls, data: dict, root: dict) -> None:
    """Moves each key of `data` that `cls.MOVED_KEYS` lists to its new dotted place in
    `root` (a value already there wins) and drops those `cls.REMOVED_KEYS` lists, then
    does the same in the nested sections."""
    for old in getattr(cls, "REMOVED_KEYS", {}):
        data.pop(old, None)
    for old, new in getattr(cls, "MOVED_KEYS", {}).items():
        if old in data:
            value = data.pop(old)
            *parents, last = new.split(".")
            node = root
            for name in parents:
                node = node.setdefault(name, {})
            node.setdefault(last, value)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        sub, kind = data.get(f.name), hints.get(f.name)
        if isinstance(sub, dict) and isinstance(kind, type) and dataclasses.is_dataclass(kind):
            _relocate_moved(kind, sub, root)


def read_yaml(path: str | Path) -> dict:
    """The mapping in a YAML file; errors name the file (and line, for syntax errors)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        if mark is not None:
            what = " ".join(str(x) for x in (getattr(err, "context", None), getattr(err, "problem", None)) if x)
            raise ConfigError(
                f"{path}, line {mark.line + 1}, column {mark.column + 1}: not valid YAML ({what})"
            ) from None
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, got {type(data).__name__}")
    return data


def from_dict(cls, data: Any, path: str = ""):
    """Build the dataclass ``cls`` from a nested mapping, checking keys and types."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    where = path or "config"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of keys, got {type(data).__name__} {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in data if k not in fields]
    if unknown:
        raise ConfigError(_unknown_key_message(path, unknown[0], fields, cls))
    kwargs = {}
    for name, field in fields.items():
        key = f"{path}.{name}" if path else name
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], key)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{key}: required, but not set")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"{where}: {err}") from None


def to_dict(cfg) -> dict:
    """A config as plain nested dicts/lists (YAML- and JSON-able). A float field holding an
    int (an int default, e.g. ``300``) is written as a float, as reading it back makes it,
    so the YAML a run writes reads back to the same YAML (a resumed run's config.yaml)."""

    def field_value(x, f, hints):
        v = getattr(x, f.name)
        if _strip_optional(hints[f.name]) is float and isinstance(v, int) and not isinstance(v, bool):
            return float(v)
        return plain(v)

    def plain(x):
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            hints = typing.get_type_hints(type(x))
            return {f.name: field_value(x, f, hints) for f in dataclasses.fields(x)}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        return x

    return plain(cfg)


def flatten(config: dict, prefix: str = "") -> dict:
    """A nested config dict as dotted keys (`optim.lr`), lists and scalars as values."""
    out = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def dump_yaml(cfg) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


@dataclasses.dataclass(frozen=True)
class ConfigKey:
    """One leaf of a config: its dotted `key`, its `value` as YAML, its `type` and the
    `doc` its section's docstring gives it (its first line; "" when none) and `text`,
    all that the docstring says of it."""

    key: str
    value: str
    type: str
    doc: str
    text: str = ""


def config_keys(cfg) -> list[ConfigKey]:
    """Every dotted key of the config `cfg` (a dataclass instance), in field order; what
    `jaxagent config` prints and the documentation site's config reference lists."""
    keys: list[ConfigKey] = []

    def walk(x, prefix: str) -> None:
        hints = typing.get_type_hints(type(x))
        names = [f.name for f in dataclasses.fields(x)]
        docs, texts = _field_docs(type(x)), _field_docs(type(x), full=True)
        for table in (docs, texts):
            for span in [k for k in table if "..." in k]:  # "a ... b: text" documents a through b
                first, last = (part.strip() for part in span.split("..."))
                if first in names and last in names:
                    for name in names[names.index(first) : names.index(last) + 1]:
                        table.setdefault(name, table[span])
        for f in dataclasses.fields(x):
            value, key = getattr(x, f.name), prefix + f.name
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                walk(value, key + ".")
                continue
            shown = yaml.safe_dump(to_dict(value), default_flow_style=True, width=10**6).strip()
            shown = shown.removesuffix("\n...").removesuffix(" ...").strip()
            keys.append(
                ConfigKey(
                    key, shown, _type_name(hints.get(f.name, f.type)), docs.get(f.name, ""), texts.get(f.name, "")
                )
            )

    walk(cfg, "")
    return keys


def describe_config(cfg) -> list[str]:
    """Every dotted key of the config `cfg` (a dataclass instance), one line each:
    `key = value  # type: what the section's docstring says of it` (what `jaxagent config`
    prints)."""
    return [f"{k.key} = {k.value}  # {k.type}" + (f": {k.doc}" if k.doc else "") for k in config_keys(cfg)]


def _field_docs(cls, full: bool = False) -> dict[str, str]:
    """`name: text` lines of a dataclass's docstring (`a, b: text` documents both): the
    first line of each text, or with `full` the whole text (its more-indented
    continuation lines joined)."""
    out: dict[str, str] = {}
    current: tuple[list[str], int, list[str]] | None = None  # (names, indent, text lines)

    def close() -> None:
        if current is not None:
            for name in current[0]:
                out.setdefault(name, " ".join(current[2]) if full else current[2][0])

    for line in (cls.__doc__ or "").splitlines():
        indent = len(line) - len(line.lstrip())
        if current is not None and line.strip() and indent > current[1]:
            current[2].append(line.strip())
            continue
        m = re.match(r"^\s*([A-Za-z_][\w]*(?:\s*,\s*[A-Za-z_][\w]*)*(?:\s*\.\.\.\s*[A-Za-z_]\w*)?)\s*:\s+(.+)$", line)
        close()
        current = None
        if m:
            current = ([n.strip() for n in re.split(r"\s*,\s*", m.group(1))], indent, [m.group(2).strip()])
    close()
    return out


# ---------------------------------------------------------------- conversion


def _type_name(tp) -> str:
    if tp is type(None):
        return "None"
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _convert(tp, value, key: str):
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if isinstance(value, dict) and sum(map(dataclasses.is_dataclass, options)) == 1:
            # a mapping for an optional section: its own errors (unknown key, bad value) say more
            return from_dict(next(a for a in options if dataclasses.is_dataclass(a)), value, key)
        for option in options:
            try:
                return _convert(option, value, key)
            except ConfigError:
                pass
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value in args:
            return value
        raise ConfigError(f"{key}: must be one of {list(args)}, got {value!r}")
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list ({_type_name(tp)}), got {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{key}: expected {len(args)} items ({_type_name(tp)}), got {len(value)}")
            items = [_convert(a, v, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True))]
        else:
            item_tp = args[0] if args else Any
            items = [_convert(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping ({_type_name(tp)}), got {value!r}")
        k_tp, v_tp = args if args else (Any, Any)
        return {_convert(k_tp, k, f"{key}.<key>"): _convert(v_tp, v, f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")


# ---------------------------------------------------------------- overrides


def _split_override(item: str) -> tuple[str, str]:
    if not isinstance(item, str) or "=" not in item:
        raise ConfigError(f"override {item!r} must look like key=value (e.g. algo.clip_high=0.28)")
    key, _, value = item.partition("=")
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r}: bad key {key!r}")
    return key, value.strip()


def _field_type(cls, parts: list[str], full_key: str):
    """The declared type of a dotted key, checking each step exists."""
    tp = cls
    for i, part in enumerate(parts):
        section = ".".join(parts[:i])
        tp = _strip_optional(tp)
        if dataclasses.is_dataclass(tp):
            fields = {f.name: f for f in dataclasses.fields(tp) if f.init}
            if part not in fields:
                raise ConfigError(_unknown_key_message(section, part, fields, tp))
            tp = typing.get_type_hints(tp)[part]
        elif typing.get_origin(tp) is dict or tp is Any:
            tp = typing.get_args(tp)[1] if typing.get_args(tp) else Any
        else:
            raise ConfigError(f"override {full_key}: {section} holds a value of type {_type_name(tp)}, not a section")
    return tp


def _strip_optional(tp):
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return tp


def _parse_scalar(tp, text: str, key: str):
    """Parse an override's text by the type of its field."""
    base = _strip_optional(tp)
    if text.lower() in ("null", "none", "~") and base is not tp:
        return None
    if base is str:
        return text
    if base is float:
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"{key}: expected float, got {text!r}") from None
    if base is int:
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"{key}: expected int, got {text!r}") from None
    if base is bool:
        lowered = text.lower()
        if lowered in ("true", "yes", "on", "1"):
            return True
        if lowered in ("false", "no", "off", "0"):
            return False
        raise ConfigError(f"{key}: expected a bool (true/false), got {text!r}")
    try:
        return safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{key}: cannot parse {text!r}: {err}") from None


def _set_dotted(cls, data: dict, key: str, text: str) -> None:
    parts = key.split(".")
    value = _parse_scalar(_field_type(cls, parts, key), text, key)
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise ConfigError(f"override {key}: {part} is set to {child!r} in the file, not a section")
        node = child
    node[parts[-1]] = value


def _unknown_key_message(section: str, key: str, fields: dict, cls=None) -> str:
    """The error for `key`, not a field of the section `section` (the dataclass `cls`): a
    key the section lists in its `MOVED_KEYS` (old key -> new dotted key) names where it
    went, one in its `REPLACED_KEYS` (old key -> what to set) what replaced it, one in its
    `REMOVED_KEYS` (old key -> why) why it went; any other lists the section's keys and
    suggests the closest."""
    full = f"{section}.{key}" if section else key
    moved = getattr(cls, "MOVED_KEYS", {}).get(key)
    if moved is not None:
        return f"config key {full} moved to {moved}: set {moved} instead of {full}"
    replaced = getattr(cls, "REPLACED_KEYS", {}).get(key)
    if replaced is not None:
        return f"config key {full} was replaced: set {replaced}"
    removed = getattr(cls, "REMOVED_KEYS", {}).get(key)
    if removed is not None:
        return f"config key {full} was removed: {removed}"
    known = sorted(fields)
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown config key {full!r}{hint} (valid keys{' of ' + section if section else ''}: {', '.join(known)})"
