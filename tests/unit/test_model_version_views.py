"""Model versions in the ops views, without daemons: the worker's status (bounded),
its metrics, the SDK's WorkerInfo and JSON, and the ``collectives status`` table
with its lagging-model markers."""

from __future__ import annotations

import json

import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from torch import nn

from collectives.observe import status_tables
from collectives.v1 import coordinator_pb2, status_pb2
from collectives.wire.cluster_state import ClusterSnapshot
from collectives_server.control_protocol import FIELD_LIMITS
from collectives_server.worker.config import WorkerConfig
from collectives_server.worker.context import WorkerContext
from collectives_server.worker.data.replaced_memory import ReplacedMemory
from collectives_server.worker.data.shm_segments import WorkerSegments
from collectives_server.worker.data.store import TensorStore
from collectives_server.worker.enrolment import bounded_status
from collectives_server.worker.metrics import worker_registry
from collectives_server.worker.models.archive.upload import ModelUploads
from collectives_server.worker.models.registry import ModelRegistry
from collectives_server.worker.stats import WorkerStats
from collectives_server.worker.status import (
    MODEL_VERSIONS_BUDGET_BYTES,
    add_model_versions,
    collect_status,
)

CPU = torch.device("cpu")

# ------------------------------------------------------------- worker side


def _context() -> WorkerContext:
    """A worker's context built as the daemon builds it, without its servers."""
    config = WorkerConfig(coordinator="127.0.0.1:1")
    store = TensorStore(CPU)
    return WorkerContext(
        config=config,
        devices=[CPU],
        backend="gloo",
        store=store,
        models=ModelRegistry([CPU], quota=store),
        uploads=ModelUploads(config.model_upload),
        shm_segments=WorkerSegments(config.shm_limits, quota=store),
        stats=WorkerStats(),
        replaced=ReplacedMemory(),
        op_timeout_s=30.0,
    )


def _metric(ctx: WorkerContext, name: str) -> dict[str, float]:
    """{model label: value} of the samples of ``name`` the worker's registry exports."""
    text = generate_latest(worker_registry(ctx)).decode()
    return {
        s.labels["model"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def test_status_and_metrics_carry_each_models_version() -> None:
    ctx = _context()
    ctx.models.add("mlp", nn.Linear(4, 2), "test")
    encoder = ctx.models.add("encoder", nn.Linear(2, 2), "test")
    with encoder.lock:  # as a committed publish leaves it
        encoder.version = 3

    status = collect_status(ctx)

    assert list(status.models) == ["encoder", "mlp"]  # field 3, as before
    assert [(m.name, m.version) for m in status.model_versions] == [("encoder", 3), ("mlp", 1)]
    assert status.model_versions_omitted == 0
    assert _metric(ctx, "collectives_model_version") == {"encoder": 3.0, "mlp": 1.0}
    ctx.models.remove("encoder")
    assert _metric(ctx, "collectives_model_version") == {"mlp": 1.0}


def test_model_versions_stay_within_their_budget_and_count_the_rest() -> None:
    longest = [(f"{i:04d}" + "n" * 252, 1 << 40) for i in range(1000)]  # 256-char names
    status = status_pb2.WorkerStatus()
    add_model_versions(status, longest)
    listed = len(status.model_versions)
    assert 50 <= listed < 1000 and status.model_versions_omitted == 1000 - listed
    assert [m.name for m in status.model_versions] == [n for n, _ in longest[:listed]]
    alone = status_pb2.WorkerStatus(model_versions=status.model_versions)
    assert alone.ByteSize() <= MODEL_VERSIONS_BUDGET_BYTES

    # 1000 short names: the versions list stays under its budget, so with every
    # name in field 3 the whole status still fits the heartbeat's limit.
    short = [(f"model-{i:04d}", i + 1) for i in range(1000)]
    status = status_pb2.WorkerStatus(models=[n for n, _ in short])
    add_model_versions(status, short)
    assert 0 < status.model_versions_omitted < 1000
    assert status.ByteSize() <= FIELD_LIMITS["status"]
    assert bounded_status(status) is status

    few = status_pb2.WorkerStatus()
    add_model_versions(few, [("a", 2), ("b", 7)])
    assert [(m.name, m.version) for m in few.model_versions] == [("a", 2), ("b", 7)]
    assert few.model_versions_omitted == 0


# --------------------------------------------------------------- client side

_READY = coordinator_pb2.WORKER_STATE_READY
_LOST = coordinator_pb2.WORKER_STATE_LOST


def _cluster(
    workers: list[tuple[str, int, dict[str, int]]], extra_names: tuple[str, ...] = ()
) -> ClusterSnapshot:
    """A snapshot of workers given as (address, state, {model: version})."""
    msg = coordinator_pb2.Cluster(generation=2, formed=True, ready=True, world_size=2, version=5)
    for rank, (address, state, versions) in enumerate(workers):
        status = status_pb2.WorkerStatus(tensors_held=1, bytes_held=8, last_op="publish")
        status.models.extend(sorted([*versions, *extra_names]))
        for name in sorted(versions):
            status.model_versions.add(name=name, version=versions[name])
        status.model_versions_omitted = len(extra_names)
        msg.workers.add(
            worker_id=f"w{rank}", rank=rank if state == _READY else -1, address=address,
            state=state, devices=["cpu"], hostname="h", pid=rank + 1, status=status,
        )  # fmt: skip
    return ClusterSnapshot.from_proto(msg)


def test_worker_info_and_json_carry_the_versions() -> None:
    snap = _cluster([("h:1", _READY, {"mlp": 3, "enc": 1})], extra_names=("zz",))
    (w,) = snap.workers
    assert w.model_versions == {"enc": 1, "mlp": 3} and w.model_versions_omitted == 1
    assert list(w.model_versions) == ["enc", "mlp"]  # name order, as the worker sends them
    data = json.loads(json.dumps(snap.to_dict()))["workers"][0]
    assert data["models"] == ["enc", "mlp", "zz"]
    assert data["model_versions"] == {"enc": 1, "mlp": 3}
    assert data["model_versions_omitted"] == 1
    bare = ClusterSnapshot.from_proto(
        coordinator_pb2.Cluster(workers=[coordinator_pb2.WorkerInfo(address="h:9")])
    ).workers[0]
    assert bare.model_versions == {} and bare.to_dict()["model_versions"] == {}


def test_table_shows_name_at_version_and_marks_a_lagging_worker() -> None:
    snap = _cluster(
        [
            ("h:1", _READY, {"mlp": 3, "enc": 2}),
            ("h:2", _READY, {"mlp": 2, "enc": 2}),
            # A lost worker's last status neither sets the newest nor is marked.
            ("h:3", _LOST, {"mlp": 9, "enc": 1}),
        ]
    )
    assert status_tables.lagging_models(snap) == {"h:2": {"mlp": 3}}

    lines = status_tables.format_table("c:1", snap, width=200).splitlines()
    header = next(line for line in lines if line.startswith("RANK"))
    assert "MODELS" in header.split()
    row = {line.split()[2]: line for line in lines if line.split()[:1] in (["0"], ["1"], ["-"])}
    assert "enc@v2 mlp@v3" in row["h:1"] and "*" not in row["h:1"]
    assert "enc@v2 mlp@v2*" in row["h:2"]
    assert "enc@v1 mlp@v9" in row["h:3"] and "*" not in row["h:3"]
    assert lines[-1] == "lagging models (* in MODELS): h:2 mlp@v2 (newest v3)"

    # At 80 columns the MODELS column may be hidden; the lagging line stays.
    narrow = status_tables.format_table("c:1", snap, width=80).splitlines()
    assert max(map(len, narrow)) <= 80
    assert narrow[-1].startswith("lagging models (* in MODELS): h:2 mlp@v2")


def test_models_cell_is_bounded_and_shows_names_without_a_version() -> None:
    many = {f"model-{i:02d}": i + 1 for i in range(40)}
    (w,) = _cluster([("h:1", _READY, many)], extra_names=("zz-over-budget",)).workers
    cell = status_tables.models_cell(w)
    assert cell.startswith("model-00@v1 model-01@v2")
    shown = cell.split()[:-1]
    assert len(" ".join(shown)) <= status_tables.MODELS_CELL_CHARS
    assert cell.split()[-1] == f"+{41 - len(shown)}"
    # A worker older than model versions reports names only.
    msg = coordinator_pb2.Cluster(
        workers=[
            coordinator_pb2.WorkerInfo(
                address="h:2", status=status_pb2.WorkerStatus(models=["mlp"])
            )
        ]
    )
    (old,) = ClusterSnapshot.from_proto(msg).workers
    assert status_tables.models_cell(old) == "mlp"
    (none,) = _cluster([("h:3", _READY, {})]).workers
    assert status_tables.models_cell(none) == "-"
    assert status_tables.lagging_models(_cluster([("h:3", _READY, {})])) == {}


def test_top_shows_how_full_each_batching_models_batches_are() -> None:
    """Each worker's status carries its batchers' counts (ModelVersion.batches and
    batched_rows); ``collectives top`` shows rows per merged forward per model and
    worker, and no batching table when no model batches."""
    statuses = {
        "h:1": [("mlp", 2, 10, 57), ("plain", 1, 0, 0)],
        "h:2": [("mlp", 2, 4, 10)],
    }
    msg = coordinator_pb2.Cluster(
        generation=3,
        workers=[
            coordinator_pb2.WorkerInfo(
                address=address,
                rank=rank,
                status=status_pb2.WorkerStatus(
                    models=[name for name, *_ in models],
                    model_versions=[
                        status_pb2.ModelVersion(
                            name=name, version=v, batches=batches, batched_rows=rows
                        )
                        for name, v, batches, rows in models
                    ],
                ),
            )
            for rank, (address, models) in enumerate(statuses.items())
        ],
    )
    snapshot = ClusterSnapshot.from_proto(msg)
    assert [w.model_batches for w in snapshot.workers] == [{"mlp": (10, 57)}, {"mlp": (4, 10)}]
    assert status_tables.batch_rows(snapshot) == [
        ("mlp", "0", "10", "57", "5.7"),
        ("mlp", "1", "4", "10", "2.5"),
    ]
    frame = status_tables.format_top("c:1", snapshot, width=200)
    assert "ROWS/FWD" in frame and "5.7" in frame and "2.5" in frame
    assert json.loads(json.dumps(snapshot.workers[0].to_dict()))["model_batches"] == {
        "mlp": [10, 57]
    }
    plain = ClusterSnapshot.from_proto(
        coordinator_pb2.Cluster(workers=[coordinator_pb2.WorkerInfo(address="h:3")])
    )
    assert status_tables.batch_rows(plain) == []
    assert "ROWS/FWD" not in status_tables.format_top("c:1", plain, width=200)
