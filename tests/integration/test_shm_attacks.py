"""Shared memory without a confused deputy.

A client names a file it does not own (root-only, 0600) in
``PutTensorShm``; before, the worker read it and ``GetTensor`` handed the bytes
out. A client names another client's segment in ``GetTensorShm``; before,
the worker overwrote it. Now the worker acts only on files owned by the uid of
the client's end of the connection (read from the kernel), so both are
PERMISSION_DENIED and the victim's bytes are untouched. Every
``GetTensorShm`` left a new ``/dev/shm`` file; the worker's segments are now
bounded and reaped. The peer's uid itself is checked with a real socket of a
process running as ``nobody`` (the kernel's answer, not ours).
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import uuid

import grpc
import pytest
import torch
from helpers import wait_until
from hostile import Aftermath, rss_bytes

import collectives
from collectives.v1 import worker_pb2, worker_pb2_grpc
from collectives.wire import codec, shm
from collectives_server.worker.transport.peer_identity import loopback_peer_uid

pytestmark = pytest.mark.timeout(180)

NOBODY = 65534
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="making a file owned by another user needs root (chown)"
)


def _file_of_another_user(payload: bytes) -> str:
    """A 0600 file in /dev/shm owned by uid nobody: not the client's (the test runs as root)."""
    path = os.path.join(shm.SHM_DIR, f"collectives-seg-victim-{uuid.uuid4().hex}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, payload)
    finally:
        os.close(fd)
    os.chown(path, NOBODY, -1)
    return path


@pytest.fixture
def client(local_cluster):
    """A connection to this module's plain cluster, shared by the attacks that need no
    flags: each leaves it as it found it (its Aftermath checks so)."""
    with collectives.connect(local_cluster(2), timeout=60) as connected:
        yield connected


def _target(client):
    return max((w for w in client.workers() if w.rank >= 0), key=lambda w: w.rank)


@needs_root
def test_a_file_the_client_does_not_own_is_not_read(client, gen) -> None:
    aftermath = Aftermath(client).capture()
    secret = torch.randn(256, generator=gen)
    path = _file_of_another_user(secret.numpy().tobytes())
    try:
        header = codec.make_header("stolen", secret)
        with grpc.insecure_channel(_target(client).address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                stub.PutTensorShm(
                    worker_pb2.PutTensorShmRequest(header=header, path=path), timeout=10
                )
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, info.value
        assert f"uid {NOBODY}" in info.value.details()
        with pytest.raises(Exception, match="NOT_FOUND"):
            client.get("stolen", rank=_target(client).rank)
    finally:
        os.unlink(path)
    aftermath.check()


@needs_root
def test_another_clients_segment_is_never_written(client, gen) -> None:
    aftermath = Aftermath(client).capture()
    victim = torch.randn(1024, generator=gen)
    path = _file_of_another_user(victim.numpy().tobytes())
    target = _target(client)
    client.put(
        "overwrite/src", torch.full((1024,), 0x41414141, dtype=torch.int32), rank=target.rank
    )
    try:
        with grpc.insecure_channel(target.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                stub.GetTensorShm(
                    worker_pb2.GetTensorShmRequest(name="overwrite/src", path=path), timeout=10
                )
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, info.value
        with open(path, "rb") as f:
            assert f.read() == victim.numpy().tobytes(), "the victim's segment was written"
    finally:
        os.unlink(path)
    aftermath.check()


def test_segments_made_for_gets_are_bounded_and_reaped(fresh_cluster, gen) -> None:
    _, client = fresh_cluster(2, "--shm-max-segments", "8", "--shm-segment-ttl-s", "2")
    aftermath = Aftermath(client).capture()
    target = _target(client)
    client.put("many/x", torch.randn(1 << 16, generator=gen), rank=target.rank)
    pattern = os.path.join(shm.SHM_DIR, f"collectives-get-{target.pid}-*")
    before_rss = rss_bytes(target.pid)
    refused = 0
    with grpc.insecure_channel(target.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        for _ in range(100):  # an attacker that never unlinks what it is given
            try:
                stub.GetTensorShm(worker_pb2.GetTensorShmRequest(name="many/x"), timeout=10)
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
                assert "--shm-max-segments 8" in err.details()
                refused += 1
            assert len(glob.glob(pattern)) <= 8
    assert refused >= 92
    # Reaped after the TTL (the heartbeat loop runs the reaper).
    wait_until(lambda: not glob.glob(pattern), 15, "the worker's shm segments reaped")
    assert rss_bytes(target.pid) < before_rss + (64 << 20)
    aftermath.check()


@needs_root
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs util-linux's setpriv")
def test_the_peer_uid_is_the_kernels_answer_for_another_users_socket() -> None:
    """A process running as nobody connects over loopback: its socket's uid is found.

    The process is bash (reachable by nobody, unlike a Python under /root)
    started through setpriv, not forked from this process: forking a process
    that runs gRPC's threads can abort the child.
    """
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        script = f"exec 3<>/dev/tcp/127.0.0.1/{port} && echo connected && read -r _"
        child = subprocess.Popen(
            ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
             "bash", "-c", script],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            server.settimeout(30)
            accepted, peer = server.accept()
            with accepted:
                assert child.stdout is not None and child.stdout.readline().strip() == "connected"
                assert loopback_peer_uid(f"ipv4:{peer[0]}:{peer[1]}", port) == NOBODY
        finally:
            if child.stdin is not None:
                child.stdin.close()
            child.wait(timeout=30)


def test_a_peer_off_loopback_gets_failed_precondition() -> None:
    from collectives.errors import FailedPrecondition

    with pytest.raises(FailedPrecondition, match="loopback"):
        loopback_peer_uid("ipv4:10.1.2.3:5000", 50051)
