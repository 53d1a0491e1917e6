"""The coordinator's servicer is written against one strategy (``ha.replication``):
the memory store's and the etcd set's each provide all of it, and the servicer no
longer asks which one it holds."""

from __future__ import annotations

import inspect
from pathlib import Path

from collectives_server.coordinator.ha.etcd_replication import EtcdReplication
from collectives_server.coordinator.ha.replication import InMemory, Replication

SERVICE = Path(__file__).resolve().parents[2] / "server/collectives_server/coordinator/service.py"


def _members(cls: type) -> set[str]:
    return {name for name, _ in inspect.getmembers(cls) if not name.startswith("_")}


def test_both_strategies_provide_the_whole_protocol() -> None:
    wanted = _members(Replication)
    assert {"leading", "held", "persist", "forward", "cut_off"} <= wanted
    assert wanted - _members(InMemory) == set()
    assert wanted - _members(EtcdReplication) == set()


def test_the_memory_store_always_leads_and_records_nothing() -> None:
    memory = InMemory()
    memory.set_identity("127.0.0.1:5")
    assert (memory.leading, memory.leader, memory.store) == (True, "127.0.0.1:5", "memory")
    assert memory.held is None and not memory.cut_off and not memory.checks_reads
    assert memory.persist(None, None, lambda: None)  # type: ignore[arg-type]


def test_the_servicer_has_no_branch_on_which_store_it_holds() -> None:
    text = SERVICE.read_text()
    assert "_replication is None" not in text and "_replication is not None" not in text
