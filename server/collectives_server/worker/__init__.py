"""A worker daemon: the composition root over its layers.

Layers, lowest first; a module imports only from its own layer and the ones
below it (``tests/unit/test_layering.py`` enforces it):

``data`` < ``transport`` < ``kernels`` < ``models`` < ``engine`` < the shared state here
(``config``, ``context``, ``telemetry/``, ``stats``, ``status``, ``metrics``)
< ``rpc`` < the daemon here (``daemon``, ``enrolment``, ``heartbeats``, ``drain_role``).

Modules:

* ``data/``: where tensors live and how their bytes arrive
* ``transport/``: the bulk port and the call lanes it carries, beside gRPC
* ``kernels/``: the data collectives on one process group
* ``models/``: hosted models: registry, execution, modes, versions, optimizers, archives
* ``engine/``: one generation's op pipeline: sequencing, announcing, agreeing, the handlers
* ``rpc/``: the gRPC servicers of the Worker service and their guards
* ``config``: the worker's configuration: one frozen dataclass
* ``context``: what handlers, status and metrics read: one WorkerContext
* ``telemetry/``: what the counters are built from: windows, error groups, clients, traffic
* ``stats``: counters: ops by kind and outcome, rates, latencies, bytes, errors, heartbeats
* ``status``: what a worker reports about itself (WorkerStatus, GetState, op logs)
* ``metrics``: the Prometheus metrics, computed at scrape time
* ``daemon``: registration, heartbeats, following generations, serving
* ``enrolment``: registration with the coordinator (token, retry key, lease secret)
* ``heartbeats``: the worker's end of the coordinator's heartbeat stream
* ``drain_role``: this worker's part in a drain (offer, copy, report, stop)
"""
