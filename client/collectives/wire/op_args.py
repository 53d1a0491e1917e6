"""Argument checks of the c10d extensions, one function per rule, used by the SDK
and the worker's servicer alike (so a rule has one wording wherever it is caught):
uneven all_to_all's split matrix, a coalesced op's names, an exchange's pairs.
The single-tensor ops' checks live beside their specs in :mod:`collectives.wire.op_specs`.

Like ``op_specs``, this module does not import torch.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Sequence

from collectives.errors import InvalidArgument
from collectives.wire.names import validate_name
from collectives.wire.op_specs import check_rank

__all__ = [
    "MAX_COALESCED",
    "check_coalesced_names",
    "check_pairs",
    "check_split_matrix",
    "split_rows",
]


# ------------------------------------------------------------ uneven all_to_all
def check_split_matrix(split_sizes: object, size: int) -> list[list[int]]:
    """all_to_all's ``split_sizes``: a ``size`` x ``size`` matrix (``size``: the group's)
    of non-negative ints; ``split_sizes[i][j]`` rows of dim 0 go from member i to member j.
    Returned as a list of lists; InvalidArgument otherwise."""
    if isinstance(split_sizes, (str, bytes)) or not isinstance(split_sizes, Sequence):
        raise InvalidArgument(
            f"split_sizes must be a list of lists of ints, got {type(split_sizes).__name__}"
        )
    if len(split_sizes) != size:
        raise InvalidArgument(
            f"split_sizes must be a {size} x {size} matrix (the group's size); "
            f"got {len(split_sizes)} rows"
        )
    matrix = []
    for i, row in enumerate(split_sizes):
        if isinstance(row, (str, bytes)) or not isinstance(row, Sequence):
            raise InvalidArgument(
                f"split_sizes[{i}] must be a list of ints, got {type(row).__name__}"
            )
        if len(row) != size:
            raise InvalidArgument(
                f"split_sizes must be a {size} x {size} matrix (the group's size); "
                f"row {i} has {len(row)} entries"
            )
        matrix.append([_split_entry(v, i, j) for j, v in enumerate(row)])
    return matrix


def _split_entry(v: object, i: int, j: int) -> int:
    try:
        if isinstance(v, bool):
            raise TypeError
        n = operator.index(v)  # numpy and 0-dim torch integers too
    except TypeError:
        raise InvalidArgument(
            f"split_sizes[{i}][{j}] must be an int, got {type(v).__name__}"
        ) from None
    if n < 0:
        raise InvalidArgument(f"split_sizes[{i}][{j}] is {n}; row counts cannot be negative")
    if n >= 1 << 62:
        raise InvalidArgument(f"split_sizes[{i}][{j}] is {n}; no tensor has that many rows")
    return n


def split_rows(flat: Sequence[int], size: int) -> list[list[int]]:
    """The wire's row-major ``split_sizes`` as rows of ``size`` (the last one may be short:
    :func:`check_split_matrix` then says so)."""
    flat = list(flat)
    step = max(size, 1)
    return [flat[i : i + step] for i in range(0, len(flat), step)]


# ------------------------------------------------------------ coalesced ops
MAX_COALESCED = 1024


def _distinct_names(values: object, what: str) -> list[str]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise InvalidArgument(f"{what} must be a list of names, got {type(values).__name__}")
    names = [validate_name(v, f"{what[:-1]} {i}") for i, v in enumerate(values)]
    if not 1 <= len(names) <= MAX_COALESCED:
        raise InvalidArgument(f"a coalesced op takes 1 to {MAX_COALESCED} {what}; got {len(names)}")
    repeated = [n for n, count in Counter(names).items() if count > 1]
    if repeated:
        shown = ", ".join(repr(n) for n in repeated[:5])
        more = f" (+{len(repeated) - 5} more)" if len(repeated) > 5 else ""
        raise InvalidArgument(f"{what} of a coalesced op must be distinct; repeated: {shown}{more}")
    return names


def check_coalesced_names(names: object, outs: object = None) -> tuple[list[str], list[str]]:
    """A coalesced op's names (1 to ``MAX_COALESCED``, distinct, each a valid name) and
    its out names (None: the results replace the names; otherwise one per name,
    distinct); returns both as lists (outs empty when None)."""
    checked = _distinct_names(names, "names")
    if outs is None:
        return checked, []
    listed = isinstance(outs, Sequence) and not isinstance(outs, (str, bytes))
    if listed and len(outs) != len(checked):  # type: ignore[arg-type]
        raise InvalidArgument(
            f"out names must be one per name: got {len(outs)} out names for "  # type: ignore[arg-type]
            f"{len(checked)} names"
        )
    return checked, _distinct_names(outs, "out names")


# --------------------------------------------------------------- point to point
def check_pairs(
    pairs: object, world_size: int, members: Sequence[int] | None = None
) -> list[tuple[int, int]]:
    """An exchange's ``(src, dst)`` pairs (``send`` is one pair): global ranks in
    ``[0, world_size)``, members of the group (``members``: its global ranks; None:
    every rank), ``src != dst``, each dst named once, at least one pair. Returned as
    tuples, in the given order."""
    if isinstance(pairs, (str, bytes)) or not isinstance(pairs, Sequence):
        raise InvalidArgument(
            f"pairs must be a list of (src, dst) pairs, got {type(pairs).__name__}"
        )
    if not pairs:
        raise InvalidArgument("pairs is empty: give at least one (src, dst) pair")
    checked: list[tuple[int, int]] = []
    for i, pair in enumerate(pairs):
        if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise InvalidArgument(
                f"pair {i} must be a (src, dst) pair of ints, got {type(pair).__name__}"
            )
        src = check_rank(pair[0], world_size, "src")
        dst = check_rank(pair[1], world_size, "dst")
        for what, rank in (("src", src), ("dst", dst)):
            if members is not None and rank not in members:
                raise InvalidArgument(
                    f"{what} {rank} (pair {i}) is not a member of the group (global ranks "
                    f"{list(members)}); src and dst are global ranks, as in torch.distributed"
                )
        if src == dst:
            raise InvalidArgument(f"pair {i} sends rank {src} to itself: src and dst must differ")
        checked.append((src, dst))
    dsts = [d for _, d in checked]
    repeated = sorted({d for d in dsts if dsts.count(d) > 1})
    if repeated:
        raise InvalidArgument(
            f"dst rank(s) {repeated} named in more than one pair; each dst receives from one src"
        )
    return checked
