"""Watching a cluster: what the operations tools read and how they show it.

==================  =============================================================
module              what it holds
==================  =============================================================
:mod:`.flight_record`  every rank's flight record read (``GetFlightRecord``) and merged by op
:mod:`.stuck_ops`   the ops in flight too long, and the ranks they wait on (``diagnose``)
:mod:`.trace_events`  a flight record as Chrome Trace Event JSON (``collectives trace``)
:mod:`.status_tables`  ``collectives status`` / ``top``: the cluster as tables
:mod:`.operations`  ``Cluster``'s operator part: ``flight_record()``
==================  =============================================================

The SDK's side only: the workers answer with the protocol's messages
(``collectives.v1``, the phases of ``collectives.wire.op_phases``).
"""
