"""Client JSON, parsed with bounds: size and nesting depth checked before ``json.loads``.

Clients hand the workers small JSON documents (factory kwargs, model kwargs,
optimizer hyperparameters). ``json.loads`` on a document nested 50,000 deep
raises ``RecursionError`` (which became INTERNAL with a traceback-like message),
and a multi-megabyte document costs the worker its parse. Here a document over
:data:`MAX_JSON_BYTES` or nested deeper than :data:`MAX_JSON_DEPTH` is
``INVALID_ARGUMENT`` before it is parsed, and any parse failure is
``INVALID_ARGUMENT`` naming what was being parsed, never the parser's internals.
"""

from __future__ import annotations

import json
import re
from typing import Any

from collectives.errors import InvalidArgument

__all__ = ["MAX_JSON_BYTES", "MAX_JSON_DEPTH", "json_depth", "parse_json", "parse_json_object"]

MAX_JSON_BYTES = 1 << 20
MAX_JSON_DEPTH = 32

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")


def json_depth(text: str) -> int:
    """The deepest nesting of arrays and objects in ``text`` (brackets inside strings
    do not count). Linear in the text, no recursion, valid JSON or not."""
    depth = deepest = 0
    for match in _BRACKET.finditer(_STRING.sub('""', text)):
        if match.group() in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth = max(depth - 1, 0)
    return deepest


def parse_json(
    text: str | bytes,
    what: str,
    *,
    max_bytes: int = MAX_JSON_BYTES,
    max_depth: int = MAX_JSON_DEPTH,
) -> Any:
    """``json.loads(text)`` within the bounds; :class:`InvalidArgument` otherwise.

    ``what`` names the document in the message ("factory kwargs").
    """
    if len(text) > max_bytes:
        raise InvalidArgument(f"{what}: {len(text)} bytes of JSON; at most {max_bytes} allowed")
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidArgument(f"{what} are not valid UTF-8 JSON") from None
    depth = json_depth(text)
    if depth > max_depth:
        raise InvalidArgument(
            f"{what}: JSON nested {depth} deep; at most {max_depth} levels allowed"
        )
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(
            f"{what} are not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except (ValueError, RecursionError):  # e.g. an integer too long to convert
        raise InvalidArgument(f"{what} are not valid JSON") from None


def parse_json_object(text: str | bytes, what: str) -> dict[str, Any]:
    """:func:`parse_json` of a JSON object; empty text is ``{}``."""
    value = parse_json(text, what) if text else {}
    if not isinstance(value, dict):
        raise InvalidArgument(f"{what} must be a JSON object")
    return value
