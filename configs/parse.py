"""Reading a config: dataclass defaults < TOML file < `--section.key=value` on the command
line, with errors that name the key, its source and the valid choices; and `--help`."""

from __future__ import annotations

import contextlib
import difflib
import math
import tomllib
import types
from dataclasses import MISSING, Field, dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from configs import ConfigError, HelpRequested
from configs.write import _toml_value, field_docs

T = TypeVar("T")

_TRUE = ("true", "1", "yes", "on")
# A key of an open section (one with an `extra_keys` hook, e.g. `[model]`, whose keys beyond its
# own fields are the chosen family's): its type is known only once the section's own values are
# (the family's name may come later on the command line), so its value waits in a _Pending.
_OPEN = object()
_FALSE = ("false", "0", "no", "off")
_NONE = ("none", "null")


@dataclass(frozen=True)
class _Pending:
    value: Any
    source: str
    cli: bool


def parse_config(cls: type[T], argv: list[str]) -> T:
    """Build `cls` from argv = `[CONFIG.toml] [--section.key=value | --section.key value] ...`.

    The TOML file may stand anywhere among the overrides (launchers such as launch/hsdp.sbatch
    put their own `--` settings first); it is always applied first, so the command line wins.
    """
    if "-h" in argv or "--help" in argv:
        raise HelpRequested(help_text(cls))
    # Values are gathered into plain nested dicts first, so each dataclass is constructed once,
    # with its final values, and its __post_init__ validates what the run will actually use.
    overrides: list[tuple[str, str | None, Any]] = []  # (key, value, type hint)
    toml_path: str | None = None
    i = 0
    while i < len(argv):  # in order, so a key given twice takes the last value
        token = argv[i]
        i += 1
        if not token.startswith("-"):
            if toml_path is not None:
                raise ConfigError(
                    f"unexpected argument {token!r}: the config file is {toml_path!r} and only "
                    "one may be given; overrides look like --section.key=value"
                )
            toml_path = token
            continue
        if not token.startswith("--") or token == "--":
            raise ConfigError(
                f"unexpected argument {token!r}: overrides look like --section.key=value"
            )
        key, has_value, raw = token[2:].partition("=")
        hint = _resolve(cls, key.replace("-", "_").split("."), f"from --{key}")
        if not has_value:
            takes_word = i < len(argv) and argv[i].lower() in _TRUE + _FALSE
            if hint is _OPEN and (i == len(argv) or argv[i].startswith("--")):
                raw = "true"  # a bare flag; its type is checked once the section is built
            elif bool in (hint, *get_args(hint)) and not takes_word:
                raw = "true"  # a bare `--flag` switches a bool on
            elif i < len(argv) and not argv[i].startswith("--"):
                raw, i = argv[i], i + 1
            else:
                raise ConfigError(f"--{key} needs a value (<{_type_name(hint)}>)")
        overrides.append((key, raw, hint))
    store: dict[str, Any] = {}
    if toml_path is not None:
        _merge_toml(store, cls, _load_toml(toml_path), "", f"from {toml_path}")
    for key, raw, hint in overrides:
        parts = key.replace("-", "_").split(".")
        node = store
        for name in parts[:-1]:
            node = node.setdefault(name, {})
        if hint is _OPEN:
            node[parts[-1]] = _Pending(raw, f"from --{key}", cli=True)
        else:
            node[parts[-1]] = _convert(raw, hint, ".".join(parts), f"from --{key}", cli=True)
    return _build(cls, store, "", None)


def help_text(cls: type) -> str:
    """Every key as `--section.key=<type> (default: X)  docstring`, grouped by section."""
    lines = [
        "usage: [CONFIG.toml] [--section.key=value | --section.key value | --flag] ...",
        "Precedence: defaults < CONFIG.toml < command line. Lists are comma-separated;",
        "'none' unsets an optional key; dashes in keys may stand for underscores.",
        "",
    ]
    _help_lines(cls, "", None, lines)
    return "\n".join(lines) + "\n"


def _load_toml(path: str) -> dict[str, Any]:
    if Path(path).is_dir():
        raise ConfigError(f"config file {path} is a directory; give a TOML file")
    if not Path(path).is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from e
    except UnicodeDecodeError as e:  # TOML is UTF-8 by definition
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}); save it as UTF-8") from e
    except OSError as e:  # permissions, a vanished mount
        raise ConfigError(f"config file {path}: cannot read it ({e.strerror})") from e


def _hints(cls: type) -> dict[str, Any]:
    # get_type_hints resolves string annotations from `from __future__ import annotations`.
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls) if f.init}


def _is_section(hint: Any) -> bool:
    return isinstance(hint, type) and is_dataclass(hint)


def _is_table_map(hint: Any) -> bool:
    """`dict[str, SomeConfig]`: named sections `[field.NAME]` of one dataclass, e.g. the
    sources of a data mixture, set from the command line as `--field.NAME.KEY=VALUE`."""
    args = get_args(hint)
    return get_origin(hint) is dict and len(args) == 2 and args[0] is str and _is_section(args[1])


def _is_union(hint: Any) -> bool:
    return get_origin(hint) in (Union, types.UnionType)


def _lookup(cls: type, name: str, prefix: str, source: str) -> Any:
    """Type of field `name` of `cls`, or a ConfigError listing the valid keys at this level."""
    hints = _hints(cls)
    if name in hints:
        return hints[name]
    if hasattr(cls, "extra_keys"):
        return _OPEN  # checked when the section is built
    close = difflib.get_close_matches(name, list(hints), n=1)
    guess = f"did you mean '{prefix}{close[0]}'? " if close else ""
    level = f"in [{prefix[:-1]}]" if prefix else "at top level"
    raise ConfigError(
        f"unknown key '{prefix}{name}' ({source}): {guess}valid keys {level}: {', '.join(hints)}"
    )


def _resolve(cls: type, parts: list[str], source: str) -> Any:
    """Type of the leaf named by a dotted command-line key, checking every level on the way."""
    i = 0
    while True:
        prefix = "".join(p + "." for p in parts[:i])
        hint = _lookup(cls, parts[i], prefix, source)
        path = prefix + parts[i]
        if _is_table_map(hint):
            entry = get_args(hint)[1]
            if i + 2 >= len(parts):  # `--map` or `--map.NAME` with no key of the entry
                raise ConfigError(
                    f"'{'.'.join(parts)}' is a section, not a value ({source}); set an entry's "
                    f"keys as --{path}.NAME.KEY=VALUE, valid keys: {', '.join(_hints(entry))}"
                )
            cls, i = entry, i + 2  # parts[i + 1] names the entry: any name is valid here
            continue
        last = i == len(parts) - 1
        if hint is _OPEN and not last:
            raise ConfigError(f"'{path}' is not a section ({source})")
        if _is_section(hint) and last:
            raise ConfigError(
                f"'{path}' is a section, not a value ({source}); set its keys as "
                f"--{path}.KEY=VALUE, valid keys: {', '.join(_hints(hint))}"
            )
        if not _is_section(hint) and not last:
            raise _not_a_section(path, hint, source)
        if last:
            return hint
        cls, i = hint, i + 1


def _not_a_section(path: str, hint: Any, source: str) -> ConfigError:
    return ConfigError(f"'{path}' is a value of type {_type_name(hint)}, not a section ({source})")


def _merge_toml(store: dict, cls: type, table: dict, prefix: str, source: str) -> None:
    for name, value in table.items():
        hint = _lookup(cls, name, prefix, source)
        path = prefix + name
        if hint is _OPEN:
            if isinstance(value, dict):
                raise ConfigError(f"'{path}' is not a section ({source})")
            store[name] = _Pending(value, source, cli=False)
        elif _is_table_map(hint):
            if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
                raise ConfigError(
                    f"'{path}' holds named sections: expected tables [{path}.NAME], got "
                    f"{value!r} ({source})"
                )
            entries = store.setdefault(name, {})
            for entry, table in value.items():
                sub = entries.setdefault(entry, {})
                _merge_toml(sub, get_args(hint)[1], table, f"{path}.{entry}.", source)
        elif _is_section(hint):
            if not isinstance(value, dict):
                raise ConfigError(
                    f"'{path}' is a section: expected a table [{path}], got {value!r} ({source})"
                )
            _merge_toml(store.setdefault(name, {}), hint, value, path + ".", source)
        elif isinstance(value, dict):
            raise _not_a_section(path, hint, source)
        else:
            store[name] = _convert(value, hint, path, source, cli=False)


def _convert(value: Any, hint: Any, path: str, source: str, cli: bool) -> Any:
    """Check a TOML value, or parse a command-line string, against a field's annotation."""
    origin, args = get_origin(hint), get_args(hint)
    if _is_union(hint):
        if type(None) in args and cli and value.lower() in _NONE:
            return None
        for member in args:  # first member that accepts the value wins, e.g. `int | str`
            if member is not type(None):
                try:
                    return _convert(value, member, path, source, cli)
                except ConfigError:
                    pass
    elif origin is Literal:
        for choice in args:
            if (str(choice) == value) if cli else (type(choice) is type(value) and choice == value):
                return choice
        choices = ", ".join(str(c) for c in args)
        raise ConfigError(f"{path}: {value!r} is not one of: {choices} ({source})")
    elif origin is list:
        if cli:
            value = [item.strip() for item in value.split(",")] if value.strip() else []
        if isinstance(value, list):
            item_type = args[0] if args else str
            return [
                _convert(v, item_type, f"{path}[{i}]", source, cli) for i, v in enumerate(value)
            ]
    elif hint is bool:
        if not cli and isinstance(value, bool):
            return value
        if cli and value.lower() in _TRUE + _FALSE:
            return value.lower() in _TRUE
    elif hint in (int, float):
        if cli:
            with contextlib.suppress(ValueError):
                value = hint(value)  # int() takes "1_000" but rejects "1.5" and "1e3"
        # type() and not isinstance(): bool is an int subclass, but `steps = true` is a mistake.
        elif type(value) is int or (hint is float and type(value) is float):
            value = hint(value)
        if type(value) is hint:
            # No setting of this trainer means anything with nan or inf (TOML and float() both
            # accept them), and either would only surface as a nan loss after training began.
            if not math.isfinite(value):
                raise ConfigError(f"{path}: expected a finite number, got {value} ({source})")
            return value
    elif hint is str:
        if cli or isinstance(value, str):
            return value
    else:
        raise TypeError(f"{path}: config annotations cannot use {hint!r}")
    raise ConfigError(f"{path}: expected {_type_name(hint)}, got {value!r} ({source})")


def _field_default(f: Field, hint: Any, defaults: Any) -> Any:
    """Default of a field, MISSING if required; None for a section means its class defaults."""
    if defaults is not None:  # the enclosing section came from e.g. `lambda: Cfg(dim=64)`
        return getattr(defaults, f.name)
    if f.default is not MISSING:
        return f.default
    if f.default_factory is hint:
        # Not called: its values are the class defaults anyway, and this way each section is
        # constructed exactly once, with its final values (its __post_init__ sees only those).
        return None
    return f.default_factory() if f.default_factory is not MISSING else MISSING


def _build(cls: type[T], store: dict, prefix: str, defaults: Any) -> T:
    hints, kwargs = _hints(cls), {}
    for f in fields(cls):
        if not f.init:
            continue
        hint, path = hints[f.name], prefix + f.name
        if _is_section(hint):
            sub_defaults = _field_default(f, hint, defaults)
            sub_defaults = None if sub_defaults is MISSING else sub_defaults
            kwargs[f.name] = _build(hint, store.get(f.name, {}), path + ".", sub_defaults)
        elif _is_table_map(hint) and f.name in store:  # given entries replace the default map
            entry = get_args(hint)[1]
            kwargs[f.name] = {
                name: _build(entry, sub, f"{path}.{name}.", None)
                for name, sub in store[f.name].items()
            }
        elif f.name in store:
            kwargs[f.name] = store[f.name]
        elif (default := _field_default(f, hint, defaults)) is not MISSING:
            kwargs[f.name] = default
        else:
            raise ConfigError(f"missing required key '{path}' (<{_type_name(hint)}>)")
    if hasattr(cls, "extra_keys"):
        kwargs |= _build_extra(cls, store, hints, kwargs, prefix, defaults)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        section = prefix[:-1]
        # Validators may already name their keys ("train.lr must ..."); don't say it twice.
        if section and not str(e).startswith((f"{section}.", f"{section}:", f"{section} ")):
            raise ConfigError(f"{section}: {e}") from e
        raise


def _build_extra(
    cls: type, store: dict, hints: dict, values: dict, prefix: str, defaults: Any
) -> dict[str, Any]:
    """An open section's keys beyond its fields, typed by its `extra_keys(values, names)` hook
    (which refuses a name it does not take, with its reason), the section default's first."""
    extra = dict(getattr(defaults, "extra", None) or {})
    for name, p in store.items():
        if name in hints:
            continue
        try:
            (hint,) = cls.extra_keys(values, [name]).values()
        except ConfigError as e:
            raise ConfigError(f"{e} ({p.source})") from None
        extra[name] = _convert(p.value, hint, prefix + name, p.source, p.cli)
    return extra


def _type_name(hint: Any) -> str:
    args = get_args(hint)
    if _is_union(hint):
        return " | ".join("none" if a is type(None) else _type_name(a) for a in args)
    if get_origin(hint) is Literal:
        return "|".join(str(a) for a in args)
    if get_origin(hint) is list:
        return f"list[{_type_name(args[0]) if args else 'str'}]"
    return getattr(hint, "__name__", str(hint))


def _help_lines(cls: type, prefix: str, defaults: Any, lines: list[str]) -> None:
    docs, hints, sections = field_docs(cls), _hints(cls), []
    for f in fields(cls):
        if not f.init:
            continue
        hint, doc = hints[f.name], " ".join(docs.get(f.name, "").split())
        if _is_section(hint) or _is_table_map(hint):
            sections.append((f, hint, doc))
            continue
        default = _field_default(f, hint, defaults)
        shown = "required" if default is MISSING else f"default: {_toml_value(default)}"
        lines.append(f"  --{prefix}{f.name}=<{_type_name(hint)}> ({shown})  {doc}".rstrip())
    for title, keys in cls.extra_help() if hasattr(cls, "extra_help") else []:
        lines.append(f"  {title}")  # an open section's other keys, e.g. per model family
        for name, (hint, shown, doc) in keys.items():
            lines.append(f"    --{prefix}{name}=<{_type_name(hint)}> ({shown})  {doc}".rstrip())
    for f, hint, doc in sections:
        if _is_table_map(hint):  # one entry's keys, under the placeholder NAME
            lines += ["", f"[{prefix}{f.name}.NAME]  {doc}".rstrip()]
            _help_lines(get_args(hint)[1], f"{prefix}{f.name}.NAME.", None, lines)
            continue
        lines += ["", f"[{prefix}{f.name}]  {doc}".rstrip()]
        sub_defaults = _field_default(f, hint, defaults)
        _help_lines(
            hint, f"{prefix}{f.name}.", None if sub_defaults is MISSING else sub_defaults, lines
        )
