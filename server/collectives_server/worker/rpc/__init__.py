"""The gRPC surface of a worker (above the shared state).

Modules:

* ``service``: the Worker servicer (its parts: ``model_service``, ``p2p_service``,
  ``handoff_service``): data plane and collectives
* ``model_service``: the model RPCs
* ``p2p_service``: point-to-point, replication and group teardown
* ``handoff_service``: a drain's handoff, answered to the successor
* ``bulk_answers``: a stored tensor answered inline or by a bulk ticket
* ``shm_service``: same-host shared-memory transfers
* ``guards``: domain errors to gRPC statuses; each call counted
* ``leader``: what an RPC that runs an op needs of the leader: its generation, the wait,
  the reply of a committed collective
"""
