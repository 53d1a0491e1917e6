"""Limits both sides agree on: message sizes, the bulk threshold, a model load's time.

Kept apart from :mod:`.codec` (which imports torch) so that the torch-free
channel setup (``collectives status``, the daemons' ``--help``) can use it.
"""

from __future__ import annotations

__all__ = ["BULK_MIN_BYTES", "MAX_MESSAGE_BYTES", "MODEL_LOAD_TIMEOUT_S"]

# Largest gRPC message either side sends: a 4 MiB tensor chunk plus headers.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024 + 64 * 1024

# Below this a tensor's payload goes through gRPC (one chunk), not the bulk port:
# a connection costs more than it saves.
BULK_MIN_BYTES = 1 << 20

# How long a worker lets the load of one model archive take by default
# (``--model-load-timeout-s``; a sandboxed trial load starts a Python that imports
# torch). A load_model without ``timeout=`` allows this on top of the op timeout.
MODEL_LOAD_TIMEOUT_S = 120.0
