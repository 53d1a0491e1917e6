"""Coordinators in an HA set on etcd: one leader decides, standbys follow.

Modules:

* ``etcd_store``: the membership document in etcd, and leader election
* ``replication``: where decisions are kept, the strategy the servicer is written against,
  and the memory store's (this process alone)
* ``etcd_replication``: an HA set's strategy: record to etcd, follow the leader, forward
* ``membership_state``: the membership as a JSON document a successor restores
"""
