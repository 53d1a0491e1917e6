"""Fixtures of the integration tests in this directory: ``env``, raw gRPC access
(``raw_grpc``) to the shared 2-worker cluster for the bad-input tests. The
fixtures every test shares are in tests/conftest.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from error_fields import field_problems, recording_errors
from raw_grpc import TIMEOUT_S, Env

from collectives.v1 import worker_pb2


@pytest.fixture(scope="module")
def env(cluster2_address: str, cluster2):  # cluster2: waits until every worker is ready
    e = Env(cluster2_address)
    # A model for the model rows: a factory the shared clusters allow.
    spec = worker_pb2.ModelSpec(
        name=e.model,
        factory="collectives_server.model_zoo:mlp",
        factory_kwargs_json=json.dumps({"in_features": 4, "hidden": 3, "out_features": 2}),
    )
    for stub in e.stubs:
        stub.LoadModel(iter([worker_pb2.LoadModelRequest(spec=spec)]), timeout=TIMEOUT_S)
    yield e
    for stub in e.stubs:
        stub.UnloadModel(worker_pb2.UnloadModelRequest(name=e.model, missing_ok=True), timeout=10)
    e.close()


@pytest.fixture(autouse=True)
def _errors_carry_their_fields() -> Iterator[None]:
    """Every error a test provokes names what the server knows (tests/error_fields.py)."""
    with recording_errors() as made:
        yield
    problems = {f"{err!r}: {why}" for err in made for why in field_problems(err)}
    assert not problems, "errors with incomplete fields:\n" + "\n".join(sorted(problems))
