"""Settings declared once: each configuration field carries its flag, help and bounds.

A daemon's configuration is a frozen dataclass (``WorkerConfig``,
``CoordinatorConfig``, and the bounds dataclasses they hold). A field a user
may set is declared with :func:`setting`: its default, its command-line
flag, the help line and the parser that checks the bounds. From that one
declaration:

- :func:`add_flags` adds the argparse options (walking into nested config
  dataclasses such as ``WorkerConfig.rpc_limits``);
- :func:`from_flags` builds the dataclass from the parsed flags;
- :func:`to_argv` turns a config back into the flags that make it (``local``
  builds one ``WorkerConfig`` and hands it to every worker it starts);
- :func:`flag_rows` lists every flag with its default and help (the flag
  tables of ``docs/deploying.md`` are checked against it).

A new flag is therefore one field: the CLI, ``local``, ``LocalCluster`` and the
docs' table follow from it.

The argument parsers (``positive_int``, ``byte_size`` ...) are here too: they
are the bounds of the declarations.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import MISSING, dataclass, field
from typing import Any

__all__ = [
    "ARCHIVES",
    "DATA_PLANE",
    "Flag",
    "add_flags",
    "byte_size",
    "flag_rows",
    "flag_value",
    "from_flags",
    "metrics_host_setting",
    "metrics_port_setting",
    "host_port",
    "host_ports",
    "non_negative_float",
    "non_negative_int",
    "port_number",
    "positive_float",
    "positive_int",
    "setting",
    "to_argv",
]

_KEY = "collectives.flag"

# Titles of the --help sections settings may belong to.
DATA_PLANE = "data-plane bounds (see docs/security.md)"
ARCHIVES = "model archives (see docs/security.md)"


@dataclass(frozen=True)
class Flag:
    """How one field is set from the command line.

    ``action``: ``None`` (the flag takes a value, parsed by ``parse``),
    ``"store_true"`` / ``"store_false"`` (a switch that sets the field to
    True / False), ``"append"`` (repeatable; ``to_value`` turns the list into
    the field) or ``"optional"`` (``--x`` / ``--no-x``; absent: None, which
    the command resolves). ``shown_default`` is the help's default text
    (None: the field's default). ``passed_on``: ``local`` offers the flag and
    passes it on to each worker it starts (False for a worker's identity:
    its address, ports, devices).
    """

    names: tuple[str, ...]
    help: str
    parse: Callable[[str], Any] | None = None
    metavar: str | None = None
    action: str | None = None
    shown_default: str | None = None
    to_value: Callable[[Any], Any] | None = None
    to_text: Callable[[Any], str] = str
    group: str | None = None
    passed_on: bool = True
    required: bool = False


def setting(
    default: Any = MISSING,
    *,
    flag: str | tuple[str, ...],
    help: str,
    default_factory: Callable[[], Any] | Any = MISSING,
    **options: Any,
) -> Any:
    """A dataclass field set by ``flag`` (see :class:`Flag` for ``options``)."""
    names = (flag,) if isinstance(flag, str) else tuple(flag)
    meta = {_KEY: Flag(names=names, help=help, **options)}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=meta)
    if default is MISSING:
        return field(metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class _Declared:
    """One flagged field, found at ``path`` (dotted, through nested configs)."""

    path: str
    flag: Flag
    default: Any  # MISSING for a required field

    @property
    def dest(self) -> str:
        return self.path.replace(".", "__")

    @property
    def default_text(self) -> str:
        if self.flag.shown_default is not None:
            return self.flag.shown_default
        switch = self.flag.action in ("store_true", "store_false", "optional")
        if switch or self.default is None or self.default is MISSING:
            return ""
        if isinstance(self.default, float):
            return f"{self.default:g}"
        if isinstance(self.default, tuple):
            return ",".join(map(str, self.default)) or "none"
        return str(self.default)


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def _declared(cls: type, prefix: str = "") -> Iterator[_Declared]:
    for f in dataclasses.fields(cls):
        flag = f.metadata.get(_KEY)
        default = _field_default(f)
        if flag is not None:
            yield _Declared(prefix + f.name, flag, default)
        elif dataclasses.is_dataclass(default) and not isinstance(default, type):
            yield from _declared(type(default), f"{prefix}{f.name}.")


def _selected(cls: type, passed_on: bool | None) -> Iterator[_Declared]:
    for item in _declared(cls):
        if passed_on is None or item.flag.passed_on == passed_on:
            yield item


def add_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    passed_on: bool | None = None,
    help_of: Mapping[str, str] | None = None,
) -> None:
    """Adds the flags of ``cls``'s settings to ``parser`` (``passed_on``: only those
    whose :attr:`Flag.passed_on` is that; ``help_of``: a help text per field path that
    replaces the declared one, for a command whose default differs)."""
    groups: dict[str, Any] = {}
    for item in _selected(cls, passed_on):
        flag = item.flag
        target: Any = parser
        if flag.group is not None:
            if flag.group not in groups:
                groups[flag.group] = parser.add_argument_group(flag.group)
            target = groups[flag.group]
        text = (help_of or {}).get(item.path)
        if text is None:
            shown = item.default_text
            text = f"{flag.help} (default: {shown})" if shown else flag.help
        options: dict[str, Any] = {"dest": item.dest, "help": text}
        if flag.action in ("store_true", "store_false"):
            options.update(action=flag.action, default=item.default)
        elif flag.action == "optional":
            options.update(action=argparse.BooleanOptionalAction, default=None)
        elif flag.action == "append":
            options.update(action="append", default=[], metavar=flag.metavar)
        else:
            options.update(type=flag.parse, metavar=flag.metavar)
            if flag.required:
                options["required"] = True
            else:
                options["default"] = item.default
        target.add_argument(*flag.names, **options)


def from_flags(cls: type, args: argparse.Namespace, given: Mapping[str, Any] | None = None) -> Any:
    """``cls`` with every setting from its flag in ``args``; ``given`` (field path →
    value) sets fields the flags do not, or overrides them. An ``"optional"`` flag
    left out keeps the field's default."""
    given = dict(given or {})
    values: dict[str, Any] = {}
    for item in _declared(cls):
        if item.path in given or not hasattr(args, item.dest):
            continue
        value = getattr(args, item.dest)
        if item.flag.action == "optional" and value is None:
            continue
        if item.flag.to_value is not None:
            value = item.flag.to_value(value)
        values[item.path] = value
    values.update(given)
    return _build(cls, values)


def _build(cls: type, values: Mapping[str, Any], prefix: str = "") -> Any:
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        path = prefix + f.name
        if path in values:
            kwargs[f.name] = values[path]
            continue
        default = _field_default(f)
        nested = any(key.startswith(path + ".") for key in values)
        if nested and dataclasses.is_dataclass(default) and not isinstance(default, type):
            kwargs[f.name] = _build(type(default), values, path + ".")
    return cls(**kwargs)


def flag_value(args: argparse.Namespace, path: str) -> Any:
    """What the flag of the setting at ``path`` parsed to (None: an ``"optional"``
    flag left out)."""
    return getattr(args, path.replace(".", "__"))


def _value_at(config: Any, path: str) -> Any:
    value = config
    for part in path.split("."):
        value = getattr(value, part)
    return value


def to_argv(config: Any, *, passed_on: bool | None = True) -> list[str]:
    """The flags that make ``config`` from its dataclass's defaults: each setting that
    differs from its default (``"optional"`` ones always, as the command resolves their
    absence), as ``--flag=VALUE``."""
    argv: list[str] = []
    for item in _selected(type(config), passed_on):
        value = _value_at(config, item.path)
        name = item.flag.names[0]
        action = item.flag.action
        if action == "optional":
            argv.append(name if value else "--no-" + name.removeprefix("--"))
        elif value == item.default:
            continue
        elif action in ("store_true", "store_false"):
            argv.append(name)
        elif action == "append":
            argv.append(f"{name}={','.join(value)}")
        elif value is not None:
            argv.append(f"{name}={item.flag.to_text(value)}")
    return argv


def flag_rows(cls: type, *, passed_on: bool | None = None) -> list[tuple[str, str, str]]:
    """(flags, default, help) of each setting of ``cls``, in declaration order."""
    return [
        (" / ".join(item.flag.names), item.default_text or "-", item.flag.help)
        for item in _selected(cls, passed_on)
    ]


# ---- settings every daemon has ----------------------------------------------------


def metrics_port_setting() -> Any:
    """A daemon's ``--metrics-port`` (``local`` numbers its children's itself)."""
    return setting(
        None,
        flag="--metrics-port",
        parse=port_number,
        metavar="P",
        passed_on=False,
        shown_default="no metrics endpoint",
        help="serve Prometheus metrics at http://HOST:P/metrics (0: any free port, logged)",
    )


def metrics_host_setting() -> Any:
    """A daemon's ``--metrics-host``."""
    return setting(
        "127.0.0.1",
        flag="--metrics-host",
        metavar="H",
        passed_on=False,
        shown_default="127.0.0.1, this machine only",
        help="interface of the metrics endpoint",
    )


# ---- the bounds: argparse types ------------------------------------------------


def host_port(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT (e.g. 127.0.0.1:50051), got {text!r}")
    return text


def host_ports(text: str) -> str:
    """``HOST:PORT`` or a comma-separated list of them (an HA coordinator set)."""
    parts = [part.strip() for part in text.split(",")]
    for part in parts:
        host_port(part)
    return ",".join(parts)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def port_number(text: str) -> int:
    value = int(text)
    if not 0 <= value < 65536:
        raise argparse.ArgumentTypeError(
            f"must be a port in 0..65535 (0: any free port), got {text}"
        )
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


_BYTE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}  # fmt: skip


def byte_size(text: str) -> int:
    """``1048576``, ``64MiB``, ``2G`` ... → a positive number of bytes."""
    stripped = text.strip().lower().replace("_", "")
    digits = stripped.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = stripped[len(digits) :]
    try:
        value = float(digits) * _BYTE_UNITS[unit]
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; use bytes or a unit (e.g. 1048576, 512MiB, 2GiB)"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 byte, got {text}")
    return int(value)
