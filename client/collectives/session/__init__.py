"""The connection behind a ``Cluster``: what every call of every part stands on.

==========================  =========================================================
module                      what it holds
==========================  =========================================================
:mod:`.connection`          ``ClusterSession``: the coordinator channel, the cluster view
                            that follows it, a channel per worker, deadlines, retries,
                            the op order
:mod:`.membership_watch`    the ``WatchCluster`` stream, followed in a background thread
:mod:`.views`               what ``Cluster`` shows of the cluster without an RPC
:mod:`.generation_binding`  which failed collectives are retried (never-started ones)
:mod:`.drains`              drains and rolling restarts, as the coordinator runs them
==========================  =========================================================

Layers of the SDK, lowest first (``tests/unit/test_layering.py`` holds them): the
protocol and the leaves (``wire``, ``v1``, ``errors``, ``reduce_ops``, ``addresses``,
``work``, ``groups``, ``_deadlines``, ``_progress``, ``_validation``), ``transport``,
``session``, ``ops``, ``models`` (with ``data_parallel``), ``observe`` (with
``flight_record``), the ``Cluster`` facade, ``cli``.
"""
