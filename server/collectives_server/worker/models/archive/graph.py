"""Checks on a serialized ``torch.export`` graph (``models/<m>.json``) before torch reads it.

What in the graph could make the deserializer run code or import modules:

- node targets: ``torch.ops.<namespace>.<op>`` (a custom namespace can trigger
  lazy op registration), ``#``-prefixed extension ops, arbitrary dotted paths.
  Only ``torch.ops.aten.*`` and a short list of ``_operator``/``math``/
  ``torch.sym_*`` functions pass;
- symbolic expressions (``expr_str``), which torch hands to ``sympy.sympify``,
  i.e. to ``eval``: each must tokenize into integers, symbol names, a short
  list of sympy/torch function names, ``Symbol('s0', integer=True, ...)``
  declarations and arithmetic; no attribute access, subscripts, dunders or
  other strings;
- ``guards_code`` (Python source torch execs into a guard function when the
  archive has sample inputs): :mod:`archive` drops the sample inputs and writes
  the graph back with ``guards_code`` empty, so it is never compiled;
- custom (script/torchbind/opaque) objects anywhere in the graph.
"""

from __future__ import annotations

import re
from typing import Any

from collectives.errors import InvalidArgument

__all__ = ["check_graph", "check_expr"]

_ATEN_RE = re.compile(r"^torch\.ops\.aten\.[A-Za-z0-9_]{1,128}\.[A-Za-z0-9_]{1,128}$")
_FUNCTIONS = frozenset(
    {
        f"_operator.{n}"
        for n in [
            "getitem",
            "add",
            "sub",
            "mul",
            "truediv",
            "floordiv",
            "mod",
            "pow",
            "neg",
            "pos",
            "abs",
            "eq",
            "ne",
            "lt",
            "le",
            "gt",
            "ge",
            "and_",
            "or_",
            "xor",
            "not_",
            "invert",
            "lshift",
            "rshift",
        ]
    }
    | {f"math.{n}" for n in ("ceil", "floor", "trunc", "sqrt", "exp", "log")}
    | {
        f"torch.{n}"
        for n in (
            [
                "sym_int",
                "sym_float",
                "sym_max",
                "sym_min",
                "sym_not",
                "sym_ite",
                "sym_sum",
                "_sym_sqrt",
            ]
        )
    }
)
# Names sympify may see: torch's sympy functions (its deserializer's locals),
# sympy's relations/logic and the Symbol declaration with its assumptions.
_EXPR_NAMES = frozenset(
    [
        # sympy's arithmetic, as srepr writes it: a stride of a tensor whose
        # dynamic dimension is not its first is Mul(Integer(4), Symbol('s0', ...)).
        "Add",
        "Mul",
        "Pow",
        "FloorDiv",
        "ModularIndexing",
        "Where",
        "PythonMod",
        "Mod",
        "CleanDiv",
        "CeilToInt",
        "FloorToInt",
        "CeilDiv",
        "LShift",
        "RShift",
        "PowByNatural",
        "FloatPow",
        "FloatTrueDiv",
        "IntTrueDiv",
        "IsNonOverlappingAndDenseIndicator",
        "TruncToFloat",
        "TruncToInt",
        "RoundToInt",
        "RoundDecimal",
        "ToFloat",
        "Identity",
        "Max",
        "Min",
        "Eq",
        "Ne",
        "Lt",
        "Le",
        "Gt",
        "Ge",
        "StrictLessThan",
        "StrictGreaterThan",
        "LessThan",
        "GreaterThan",
        "Unequality",
        "Equality",
        "And",
        "Or",
        "Not",
        "Abs",
        "floor",
        "ceiling",
        "Piecewise",
        "Integer",
        "Rational",
        "Float",
        "Symbol",
        "True",
        "False",
        "oo",
        "zoo",
        "nan",
        "integer",
        "positive",
        "negative",
        "nonnegative",
        "nonpositive",
        "real",
        "finite",
    ]
)
_SYMBOL_RE = re.compile(r"^[a-z]{1,8}[0-9]{1,9}$")  # s0, u12, zuf3 ...
_TOKEN_RE = re.compile(
    r"\s*(?:(?P<num>\d{1,40}(?:\.\d{1,40})?(?:e[+-]?\d{1,4})?)"
    r"|(?P<name>[A-Za-z][A-Za-z0-9_]{0,63})"
    r"|(?P<str>'[a-z]{1,8}[0-9]{1,9}')"
    r"|(?P<op>\*\*|//|==|!=|<=|>=|[-+*/%(),<>=&|~]))"
)
_MAX_EXPR = 4096


def _refuse(message: str) -> InvalidArgument:
    return InvalidArgument(
        f"model archive refused: {message}; export a model made of standard (aten) "
        "operators with torch.export.save, or load it with a factory"
    )


def check_expr(expr: str) -> None:
    """Refuses a symbolic expression that is more than arithmetic over symbols."""
    if not isinstance(expr, str) or len(expr) > _MAX_EXPR:
        raise _refuse("a symbolic expression is not a short string")
    pos = 0
    while pos < len(expr):
        m = _TOKEN_RE.match(expr, pos)
        if m is None or m.end() == pos:
            if expr[pos:].strip() == "":
                break
            raise _refuse(f"symbolic expression {expr[:80]!r} has an unexpected character")
        name = m.group("name")
        if name is not None and name not in _EXPR_NAMES and not _SYMBOL_RE.match(name):
            raise _refuse(f"symbolic expression {expr[:80]!r} uses {name!r}")
        pos = m.end()


def _check_target(target: Any) -> None:
    if not isinstance(target, str) or not (_ATEN_RE.match(target) or target in _FUNCTIONS):
        raise _refuse(
            f"node target {str(target)[:120]!r} is not an aten operator "
            "(custom or extension operators are not accepted)"
        )


def check_graph(rel: str, program: Any) -> None:
    """Walks the whole serialized program (iteratively; depth already bounded)."""
    if not isinstance(program, dict) or not isinstance(program.get("graph_module"), dict):
        raise _refuse(f"{rel!r} is not a serialized ExportedProgram")
    guards = program.get("guards_code", [])
    if not isinstance(guards, list) or not all(isinstance(g, str) for g in guards):
        raise _refuse(f"{rel!r}: guards_code is not a list of strings")
    stack: list[Any] = [program]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
            continue
        if not isinstance(item, dict):
            continue
        for key, value in item.items():
            if key in ("as_custom_obj", "as_custom_objs", "custom_obj", "custom_obj_values"):
                if value:
                    raise _refuse(f"{rel!r} uses a custom (script/opaque) object")
            elif key == "expr_str":
                check_expr(value)
            elif key == "target" and "inputs" in item and "outputs" in item:
                _check_target(value)
            if isinstance(value, dict | list):
                stack.append(value)
