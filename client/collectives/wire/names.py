"""Names both sides spell the same way.

Tensor names (1-256 characters of ``[A-Za-z0-9_.:/-]``) and their reserved
prefixes; the gRPC metadata key that names a model on its upload streams; the
losses and optimizers the workers know by name.
"""

from __future__ import annotations

import re

from collectives.errors import InvalidArgument

__all__ = [
    "ARCHIVE_PREFIX",
    "BUILTIN_LOSSES",
    "FUNCTION_PREFIX",
    "MAX_NAME_LENGTH",
    "MODEL_METADATA_KEY",
    "OPTIMIZERS",
    "UPLOAD_PREFIX",
    "reserved_prefix",
    "validate_name",
]

MAX_NAME_LENGTH = 256
# Reserved: a publish's uploads wait on the leader under "__publish/<id>/<key>".
UPLOAD_PREFIX = "__publish/"
# Reserved: load_model stages a model archive on every rank as "__archive/<id>"
# (a replicated put), then each worker's LoadModel reads and deletes it.
ARCHIVE_PREFIX = "__archive/"
# The gRPC metadata key naming the model a LoadModel / GetModelTensors stream is for.
MODEL_METADATA_KEY = "collectives-model"
# The losses ``train_step`` computes on the workers by name.
BUILTIN_LOSSES = ("mse", "cross_entropy")
# Reserved model names: a function the SDK exported for ``apply`` or as a
# ``train_step`` loss is loaded on the workers as "__fn/<digest of its archive>".
FUNCTION_PREFIX = "__fn/"
# The optimizers ``step`` and ``train_step`` build on the workers by name.
OPTIMIZERS = ("sgd", "adam", "adamw")
_NAME_RE = re.compile(r"[A-Za-z0-9_.:/-]{1,256}")


def validate_name(name: object, what: str = "tensor name") -> str:
    """Returns ``name`` if valid, else raises :class:`InvalidArgument` saying why."""
    if not isinstance(name, str):
        raise InvalidArgument(f"{what} must be a str, got {type(name).__name__}")
    if not name:
        raise InvalidArgument(f"{what} must not be empty")
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidArgument(
            f"{what} is {len(name)} characters long; the limit is {MAX_NAME_LENGTH}"
        )
    if not _NAME_RE.fullmatch(name):
        bad = sorted({c for c in name if not re.fullmatch(r"[A-Za-z0-9_.:/-]", c)})
        raise InvalidArgument(
            f"{what} {name[:64]!r} contains {''.join(bad)!r}; allowed are A-Z a-z 0-9 _ . : / -"
        )
    return name


def reserved_prefix(name: str) -> str | None:
    """The reserved prefix ``name`` starts with (a user's put may not), else None."""
    for prefix in (UPLOAD_PREFIX, ARCHIVE_PREFIX):
        if name.startswith(prefix):
            return prefix
    return None
