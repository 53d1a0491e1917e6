"""TLS, mutual TLS and bearer tokens on real clusters, with certificates made here.

Three clusters (each ``collectives-server local``, 2 CPU workers): TLS only;
mutual TLS with a token; plaintext with a token. Every refusal is checked for
its status code, and a refused request for not having read or changed data.
"""

from __future__ import annotations

import datetime
import functools
import ipaddress
import json
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch

cryptography = pytest.importorskip("cryptography")

from cryptography import x509  # noqa: E402
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID  # noqa: E402
from helpers import wait_until  # noqa: E402
from launcher import LocalCluster, free_port_block  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import collectives  # noqa: E402
from collectives import PermissionDenied, Unavailable  # noqa: E402
from collectives.transport.endpoints import WorkerEndpoint, get_tensor, put_tensor  # noqa: E402
from collectives.v1 import (  # noqa: E402
    coordinator_pb2,
    coordinator_pb2_grpc,
    tensor_pb2,
    worker_pb2,
    worker_pb2_grpc,
)
from collectives.wire.frames import ACK, LANE, prelude  # noqa: E402
from collectives.wire.security import ChannelSecurity  # noqa: E402

pytestmark = [pytest.mark.timeout(120)]

TOKEN = "s3cret-token-for-tests"
WORKERS = 2


# ------------------------------------------------------------------ certificates


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    token_file: Path
    wrong_token_file: Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _issue(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Name,
    issuer_key: ec.EllipticCurvePrivateKey,
    *,
    ca: bool = False,
    san: list[x509.GeneralName] | None = None,
    usages: list[x509.ObjectIdentifier] | None = None,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True,
                crl_sign=True, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )  # fmt: skip
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    if usages:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = _issue("collectives test CA", ca_key, _name("collectives test CA"), ca_key, ca=True)
    server_key = ec.generate_private_key(ec.SECP256R1())
    # serverAuth and clientAuth: the local launcher's workers also present it to the
    # coordinator when it requires client certificates.
    server_cert = _issue(
        "localhost", server_key, ca_cert.subject, ca_key,
        san=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
        usages=[ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
    )  # fmt: skip
    client_key = ec.generate_private_key(ec.SECP256R1())
    client_cert = _issue(
        "a client", client_key, ca_cert.subject, ca_key,
        usages=[ExtendedKeyUsageOID.CLIENT_AUTH],
    )  # fmt: skip
    pem = serialization.Encoding.PEM
    (d / "ca.pem").write_bytes(ca_cert.public_bytes(pem))
    (d / "server.pem").write_bytes(server_cert.public_bytes(pem))
    (d / "client.pem").write_bytes(client_cert.public_bytes(pem))
    _write_key(server_key, d / "server.key")
    _write_key(client_key, d / "client.key")
    (d / "token").write_text(TOKEN + "\n")
    (d / "token").chmod(0o600)
    (d / "wrong-token").write_text("not-the-token\n")
    return Pki(
        ca=d / "ca.pem",
        server_cert=d / "server.pem",
        server_key=d / "server.key",
        client_cert=d / "client.pem",
        client_key=d / "client.key",
        token_file=d / "token",
        wrong_token_file=d / "wrong-token",
    )


# ---------------------------------------------------------------------- clusters


def _start(tmp_path: Path, name: str, *flags: str) -> LocalCluster:
    cluster = LocalCluster(WORKERS, ["--devices", "cpu", *flags], tmp_path / f"{name}.log")
    cluster.start()
    return cluster


def _ready(client: collectives.Cluster) -> bool:
    members = [w for w in client.workers() if w.rank >= 0]
    return len(members) == WORKERS and all(w.state == "ready" for w in members)


def _connect(address: str, **security: object) -> collectives.Cluster:
    client = collectives.connect(address, timeout=60, **security)  # type: ignore[arg-type]
    try:
        wait_until(lambda: _ready(client), 60, f"{WORKERS} ready workers at {address}")
    except BaseException:
        client.close()
        raise
    return client


def _round_trip(client: collectives.Cluster) -> None:
    """put on every rank, all_reduce, get: the result is torch's sum."""
    inputs = [torch.arange(6, dtype=torch.float32).reshape(2, 3) * (r + 1) for r in range(WORKERS)]
    for rank, t in enumerate(inputs):
        client.put("sec_x", t, rank=rank)
    client.all_reduce("sec_x")
    expected = torch.stack(inputs).sum(0)
    for rank in range(WORKERS):
        assert torch.equal(client.get("sec_x", rank=rank), expected)
    client.delete("sec_x")
    # Large enough for the bulk port (over TLS on a TLS cluster).
    big = torch.randn(3 << 18)
    client.put("sec_big", big, rank=WORKERS - 1)
    assert torch.equal(client.get("sec_big", rank=WORKERS - 1), big)
    client.delete("sec_big")


@dataclass(frozen=True)
class TlsCluster:
    address: str
    metrics_ports: list[int]  # the workers'


@pytest.fixture(scope="module")
def tls_cluster(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsCluster]:
    base = free_port_block(WORKERS + 1)
    cluster = _start(
        tmp_path_factory.mktemp("tls"), "tls",
        f"--tls-cert={pki.server_cert}", f"--tls-key={pki.server_key}", f"--tls-ca={pki.ca}",
        "--metrics-port", str(base),
    )  # fmt: skip
    yield TlsCluster(cluster.address, [base + 1 + r for r in range(WORKERS)])
    cluster.stop()


def _lane_calls(metrics_ports: list[int]) -> float:
    """``collectives_call_lane_calls_total`` summed over the workers' /metrics."""
    total = 0.0
    for port in metrics_ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            for family in text_string_to_metric_families(r.read().decode()):
                total += sum(
                    s.value for s in family.samples if s.name == "collectives_call_lane_calls_total"
                )
    return total


def _raw_bulk_answer(address: str, port: int, context: ssl.SSLContext | None) -> bytes:
    """What the bulk port at ``address``'s host answers a lane prelude with an
    unknown ticket, through ``context`` (None: plaintext): b"" or an error when it
    closes the connection first."""
    host = address.rpartition(":")[0]
    with socket.create_connection((host, port), timeout=10) as raw:
        try:
            sock = context.wrap_socket(raw, server_hostname=host) if context else raw
            sock.sendall(prelude(LANE, bytes(16)))
            return sock.recv(1)
        except (OSError, ssl.SSLError) as exc:
            return repr(exc).encode()


# ------------------------------------------------------------------------- tests


def test_tls_end_to_end_and_plaintext_client_refused(tls_cluster: TlsCluster, pki: Pki) -> None:
    # (a) The SDK with the CA: every channel (coordinator, both workers) is TLS, and
    # so are the bulk port's connections: the large tensor and the small calls (on
    # lanes) go over TLS with the same certificate.
    with _connect(tls_cluster.address, tls_ca=str(pki.ca)) as client:
        before = _lane_calls(tls_cluster.metrics_ports)
        _round_trip(client)
        worker_addresses = [w.address for w in client.workers()]
    assert _lane_calls(tls_cluster.metrics_ports) > before

    # The bulk port speaks TLS only: a plaintext prelude gets no answer.
    creds = grpc.ssl_channel_credentials(pki.ca.read_bytes())
    with grpc.secure_channel(worker_addresses[0], creds) as channel:
        plane = worker_pb2_grpc.WorkerStub(channel).GetDataPlane(
            worker_pb2.DataPlaneRequest(), timeout=10
        )
    assert plane.bulk_port and plane.bulk_tls
    assert _raw_bulk_answer(worker_addresses[0], plane.bulk_port, None) != ACK
    trusting = ssl.create_default_context(cafile=str(pki.ca))
    # Through TLS, an unknown ticket is refused as on a plaintext port (closed, no ACK).
    assert _raw_bulk_answer(worker_addresses[0], plane.bulk_port, trusting) == b""
    coordinator = tls_cluster.address

    # (b) A plaintext client fails cleanly, UNAVAILABLE within its timeout.
    for address in [coordinator, worker_addresses[0]]:
        start = time.monotonic()
        with pytest.raises(Unavailable) as info:
            collectives.connect(address, timeout=2.0, tls=False)
        assert time.monotonic() - start < 2.0 + 3.0
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(worker_addresses[0]) as channel:
        with pytest.raises(grpc.RpcError) as raw:
            worker_pb2_grpc.WorkerStub(channel).GetState(worker_pb2.GetStateRequest(), timeout=3)
        assert raw.value.code() == grpc.StatusCode.UNAVAILABLE

    # A TLS client that does not trust the CA (system roots) is refused the same way.
    with pytest.raises(Unavailable):
        collectives.connect(coordinator, timeout=2.0, tls=True)

    # The environment supplies what the arguments do not.
    env_security = ChannelSecurity.resolve(environ={"COLLECTIVES_TLS_CA": str(pki.ca)})
    assert env_security.tls and env_security.root_certificates == pki.ca.read_bytes()

    # `collectives status` with --tls-ca.
    out = subprocess.run(
        [sys.executable, "-m", "collectives.cli.main", "status", "--coordinator", coordinator,
         "--tls-ca", str(pki.ca), "--json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["world_size"] == WORKERS


def test_mutual_tls_with_token(pki: Pki, tmp_path: Path) -> None:
    cluster = _start(
        tmp_path, "mtls",
        f"--tls-cert={pki.server_cert}", f"--tls-key={pki.server_key}",
        f"--tls-client-ca={pki.ca}", f"--tls-ca={pki.ca}", f"--token-file={pki.token_file}",
    )  # fmt: skip
    try:
        # (c) No client certificate: the handshake fails, UNAVAILABLE.
        with pytest.raises(Unavailable):
            collectives.connect(cluster.address, timeout=3.0, token=TOKEN, tls_ca=str(pki.ca))
        # A certificate but no token: UNAUTHENTICATED.
        with pytest.raises(PermissionDenied) as info:
            collectives.connect(
                cluster.address, timeout=10.0, tls_ca=str(pki.ca),
                tls_cert=str(pki.client_cert), tls_key=str(pki.client_key),
            )  # fmt: skip
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
        # Certificate and token: works end to end (workers reached the coordinator with
        # their certificate and the token too, or the cluster would not have formed).
        with _connect(
            cluster.address, token=TOKEN, tls_ca=str(pki.ca),
            tls_cert=str(pki.client_cert), tls_key=str(pki.client_key),
        ) as client:  # fmt: skip
            _round_trip(client)
            worker = client.workers()[0].address
        # Raw stub with a certificate but no token, over TLS: UNAUTHENTICATED.
        creds = grpc.ssl_channel_credentials(
            pki.ca.read_bytes(), pki.client_key.read_bytes(), pki.client_cert.read_bytes()
        )
        # The bulk port (lanes, large tensors) asks for the client certificate as the
        # gRPC port does: without one the handshake is refused.
        with grpc.secure_channel(worker, creds) as channel:
            plane = worker_pb2_grpc.WorkerStub(channel).GetDataPlane(
                worker_pb2.DataPlaneRequest(),
                timeout=10,
                metadata=(("authorization", f"Bearer {TOKEN}"),),
            )
        assert plane.bulk_port and plane.bulk_tls
        no_certificate = ssl.create_default_context(cafile=str(pki.ca))
        refused = _raw_bulk_answer(worker, plane.bulk_port, no_certificate)
        assert refused not in (b"", ACK) and b"SSL" in refused, refused
        with_certificate = ssl.create_default_context(cafile=str(pki.ca))
        with_certificate.load_cert_chain(str(pki.client_cert), str(pki.client_key))
        assert _raw_bulk_answer(worker, plane.bulk_port, with_certificate) == b""
        with grpc.secure_channel(worker, creds) as channel:
            with pytest.raises(grpc.RpcError) as raw:
                worker_pb2_grpc.WorkerStub(channel).GetState(
                    worker_pb2.GetStateRequest(), timeout=10
                )
            assert raw.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        cluster.stop()


def test_token_on_plaintext_cluster(pki: Pki, tmp_path: Path) -> None:
    cluster = _start(tmp_path, "token", f"--token-file={pki.token_file}")
    address = cluster.address
    try:
        # (d) No token, wrong token: UNAUTHENTICATED, and the message says which.
        with pytest.raises(PermissionDenied) as missing:
            collectives.connect(address, timeout=10.0)
        assert missing.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert "missing credentials" in str(missing.value)
        with pytest.raises(PermissionDenied) as wrong:
            collectives.connect(address, timeout=10.0, token="not-the-token")
        assert wrong.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert "invalid token" in str(wrong.value)

        with _connect(address, token=TOKEN) as client:
            _round_trip(client)
            workers = [w.address for w in client.workers() if w.rank >= 0]
            # (e) A refused request reads and changes nothing.
            original = torch.arange(12, dtype=torch.int64).reshape(3, 4)
            client.put("guarded", original)
            _refused_requests_change_nothing(workers, TOKEN)
            for rank in range(WORKERS):
                assert torch.equal(client.get("guarded", rank=rank), original)

        # (f) Raw stubs without a token, on the Worker service and the coordinator;
        # reflection is closed too; health stays open.
        with grpc.insecure_channel(workers[0]) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            for call in (
                lambda: stub.GetState(worker_pb2.GetStateRequest(), timeout=10),
                lambda: stub.ListTensors(worker_pb2.ListTensorsRequest(), timeout=10),
                lambda: list(stub.GetTensor(worker_pb2.GetTensorRequest(name="guarded"),
                                            timeout=10)),
                lambda: stub.GetTensorBulk(worker_pb2.GetTensorBulkRequest(name="guarded"),
                                           timeout=10),
            ):  # fmt: skip
                _assert_unauthenticated(call)
            _assert_health_open(channel)
        with grpc.insecure_channel(address) as channel:
            coordinator = coordinator_pb2_grpc.CoordinatorStub(channel)
            _assert_unauthenticated(
                lambda: coordinator.GetCluster(coordinator_pb2.GetClusterRequest(), timeout=10)
            )
            _assert_unauthenticated(
                lambda: coordinator.Register(coordinator_pb2.RegisterRequest(), timeout=10)
            )
            _assert_unauthenticated(lambda: _reflection_list(channel))
            _assert_health_open(channel)

        # `collectives status`: refused without the token (exit 2), works with it.
        base = [sys.executable, "-m", "collectives.cli.main", "status", "--coordinator", address]
        refused = subprocess.run(base, capture_output=True, text=True, timeout=60)
        assert refused.returncode == 2 and "UNAUTHENTICATED" in refused.stderr.upper()
        shown = subprocess.run(
            [*base, "--token-file", str(pki.token_file)], capture_output=True, text=True,
            timeout=60,
        )  # fmt: skip
        assert shown.returncode == 0, shown.stderr
    finally:
        cluster.stop()


def _refused_requests_change_nothing(workers: list[str], token: str) -> None:
    wrong = ChannelSecurity(token="not-the-token")
    for address in workers:
        endpoint = WorkerEndpoint.open(address, wrong)
        try:
            with pytest.raises(PermissionDenied):
                put_tensor(endpoint, "guarded", torch.zeros(3, 4, dtype=torch.int64), 10.0)
            with pytest.raises(PermissionDenied):
                put_tensor(endpoint, "intruder", torch.zeros(2), 10.0)
            with pytest.raises(PermissionDenied):
                get_tensor(endpoint, "guarded", 10.0)
            delete = worker_pb2.DeleteTensorRequest(name="guarded")
            _assert_unauthenticated(
                functools.partial(endpoint.stub.DeleteTensor, delete, timeout=10)
            )
            all_reduce = worker_pb2.AllReduceRequest(name="guarded", op=tensor_pb2.REDUCE_OP_SUM)
            _assert_unauthenticated(
                functools.partial(endpoint.stub.AllReduce, all_reduce, timeout=10)
            )
        finally:
            endpoint.channel.close()
    # Nothing named "intruder" appeared (checked with the right token).
    right = ChannelSecurity(token=token)
    for address in workers:
        endpoint = WorkerEndpoint.open(address, right)
        try:
            listed = endpoint.stub.ListTensors(worker_pb2.ListTensorsRequest(), timeout=10)
            assert "intruder" not in str(listed)
        finally:
            endpoint.channel.close()


def _assert_unauthenticated(call) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises((grpc.RpcError, PermissionDenied)) as info:
        call()
    err = info.value
    code = err.code if isinstance(err, PermissionDenied) else err.code()
    assert code == grpc.StatusCode.UNAUTHENTICATED, err


def _assert_health_open(channel: grpc.Channel) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def _reflection_list(channel: grpc.Channel) -> object:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    return list(stub.ServerReflectionInfo(iter([request]), timeout=10))


def test_the_dashboard_of_a_token_cluster_shows_no_names_clients_or_messages(
    pki: Pki, tmp_path: Path
) -> None:
    """The dashboard takes no credentials: on a token cluster it shows the workers and
    their ops' kinds and outcomes, and none of what the token guards on gRPC (the
    names an op carried, the clients, the error messages), which the token's
    holder still reads."""
    secret, client_name = "payroll/q3-gradients", "billing-batch-7"
    cluster = _start(
        tmp_path, "dashboard", f"--token-file={pki.token_file}", "--dashboard-port", "0"
    )
    try:
        dashboard = _dashboard_address(cluster)
        with _connect(cluster.address, token=TOKEN, name=client_name) as client:
            for rank in range(WORKERS):
                client.put(secret, torch.randn(7), rank=rank)
            client.all_reduce(secret)
            with pytest.raises(collectives.NotFound):
                client.all_reduce(secret + "/missing")

            def reported() -> dict | None:
                snap = client.refresh(timeout=10)
                ops = [op for w in snap.workers for op in w.recent_ops]
                errors = [e for w in snap.workers for e in w.recent_errors]
                named = any(secret in op.names for op in ops) and errors
                return snap if named else None

            # The token's holder sees names, messages and this client.
            held = wait_until(reported, 30, "the workers to report the ops")
            assert any(secret in e.message for w in held.workers for e in w.recent_errors)
            with urllib.request.urlopen(f"http://{dashboard}/api/cluster", timeout=10) as r:
                shown = r.read().decode()
            with urllib.request.urlopen(f"http://{dashboard}/api/events", timeout=10) as r:
                event = b""  # up to the end of the first event that carries data
                while b"data:" not in event or b"\n\n" not in event.split(b"data:", 1)[1]:
                    chunk = r.read1(65536)
                    assert chunk, f"the event stream ended after {event!r}"
                    event += chunk
        for body in (shown, event.decode()):
            assert secret not in body and client_name not in body
            assert "127.0.0.1:" in body  # the workers' addresses are shown
            assert "all_reduce" in body and "NOT_FOUND" in body  # kinds and outcomes are
            assert "details need the cluster's token" in body
        page = json.loads(shown)
        assert all(w["clients"] == [] for w in page["workers"])
        assert any(w["recent_ops"] for w in page["workers"])
    finally:
        cluster.stop()


def _dashboard_address(cluster: LocalCluster) -> str:
    """The dashboard's host:port, from the coordinator's log line."""

    def logged() -> str | None:
        for line in cluster.log_path.read_text().splitlines():
            if "dashboard on http://" in line:
                return line.rsplit("http://", 1)[1].strip().rstrip("/")
        return None

    return wait_until(logged, 30, "the dashboard's address in the log")


def test_a_drain_on_a_tls_cluster_moves_the_rank_over_tls(pki: Pki, tmp_path: Path) -> None:
    """The handoff's worker-to-worker copy (its gRPC calls and the bulk connection)
    speaks TLS on a TLS cluster: every tensor reaches the spare, the large one over
    the bulk port, value for value."""
    cluster = _start(
        tmp_path, "tls-drain", "--spares", "1", "--heartbeat", "0.2",
        f"--tls-cert={pki.server_cert}", f"--tls-key={pki.server_key}", f"--tls-ca={pki.ca}",
    )  # fmt: skip
    try:
        with _connect(cluster.address, tls_ca=str(pki.ca)) as client:
            wait_until(lambda: any(w.state == "spare" for w in client.workers()), 60, "the spare")
            gen = torch.Generator().manual_seed(int(time.time()))
            held = {
                "tls/small": torch.randn(100, generator=gen),
                "tls/large": torch.randn(6 << 20, generator=gen),  # 24 MiB: the bulk port
                "tls/int": torch.randint(-(2**40), 2**40, (4099,), generator=gen),
            }
            for name, t in held.items():
                client.put(name, t, rank=1)
            report = client.drain(client.workers()[1].address, timeout=60)
            assert report.error == "" and report.tensors_moved == len(held), report
            for name, t in held.items():
                assert torch.equal(client.get(name, rank=1), t), name
    finally:
        cluster.stop()
