"""Coordinators in an HA set on etcd: one leader decides, standbys follow.

Modules:

* ``etcd_store``: the membership document in etcd, and leader election
* ``replication``: what a coordinator does beyond deciding: record, follow, forward
* ``membership_state``: the membership as a JSON document a successor restores
"""
