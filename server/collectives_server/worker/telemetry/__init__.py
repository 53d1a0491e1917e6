"""Telemetry the worker's counters are built from: bounded, cheap to record.

In the worker's shared-state layer (see ``collectives_server.worker``): the
engine and the RPC guards record into these through ``stats`` and the context;
``status`` and ``metrics`` read them.

* ``windows``: bounded recent windows: an event rate, latency percentiles
* ``error_groups``: failed ops aggregated by kind, code and message, with a count
* ``clients``: the clients that called recently (peer, user agent, the name they gave)
* ``collective_traffic``: the payload bytes a collective moves per rank (a model)
* ``flight_record``: the flight recorder's ops as GetFlightRecord answers them, phase histograms
* ``forward_load``: forwards in flight now (the load clients place small requests by), routed ones
"""
