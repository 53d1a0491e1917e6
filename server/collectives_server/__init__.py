"""Daemons of the collectives service: the coordinator, the workers, and a local launcher."""

import os

__version__ = "0.1.0"

# Transparent huge pages for torch's large CPU allocations in the daemons (torch
# reads this once, at its first allocation of 2 MiB or more, so it is set on
# import, before any). Every received tensor and every collective's output is a
# fresh allocation; with 4 KiB pages the kernel's per-page faults cost more than
# the copy itself (0.6-2 GB/s vs 10-20 GB/s measured). Set it to 0 to opt out.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

# grpcio's sockets through its classic poller instead of its EventEngine: with
# the EventEngine, every message wakes one of its threads, which then wakes the
# server's polling thread and the handler's, ~7.5 context switches per heartbeat
# against ~3. grpc reads this once, when it is first imported, so it is set here:
# the package runs first under both entry points (``python -m collectives_server``
# and the ``collectives-server`` script), before any of its modules imports grpc.
# A value the user exported is kept (an empty one restores grpc's defaults). A
# program that imports collectives_server itself before grpc gets it too; one
# that imported grpc first keeps grpc's defaults. Measured on the 2-core VM, bench row 7,
# three alternated pairs: the coordinator at 1,000 workers 0.208-0.232 of a core
# -> 0.154-0.168. See docs/design.md "gRPC without its EventEngine".
GRPC_EXPERIMENTS = "-event_engine_listener,-event_engine_for_all_other_endpoints"
os.environ.setdefault("GRPC_EXPERIMENTS", GRPC_EXPERIMENTS)
