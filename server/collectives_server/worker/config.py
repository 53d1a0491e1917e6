"""Worker configuration: one frozen dataclass, units in the names, each flag declared once.

Every field a user sets carries its ``collectives-server worker`` flag (see
:mod:`collectives_server.settings`); ``local`` offers the ones marked
``passed_on`` and hands each worker the config it built. The security fields
are read from the files the security flags name (``cli/common.py``).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from collectives.errors import InvalidArgument
from collectives.wire.batching import Batching
from collectives.wire.security import PLAINTEXT, ChannelSecurity
from collectives_server.rpc.limits import RpcLimits
from collectives_server.security import ServerSecurity
from collectives_server.settings import (
    byte_size,
    host_ports,
    metrics_host_setting,
    metrics_port_setting,
    non_negative_float,
    non_negative_int,
    port_number,
    positive_float,
    positive_int,
    setting,
)
from collectives_server.worker.data.limits import BulkLimits, ShmLimits
from collectives_server.worker.models.archive.checks import ModelUploadConfig
from collectives_server.worker.transport.lanes import LANE_METHODS

__all__ = ["WorkerConfig", "parse_cpus", "parse_devices"]


def parse_devices(text: str) -> tuple[str, ...]:
    """``cuda:0,cuda:1`` or ``cpu`` → the device names."""
    devices = tuple(d.strip() for d in text.split(",") if d.strip())
    for d in devices:
        kind, _, index = d.partition(":")
        if kind not in ("cpu", "cuda") or (index and not index.isdigit()):
            raise argparse.ArgumentTypeError(f"unknown device {d!r}; use cpu or cuda:N")
    return devices


def parse_cpus(text: str) -> frozenset[int]:
    """``0-3,8`` (as ``taskset -c``) → the CPU numbers, each one this process may use."""
    cpus: set[int] = set()
    for part in (p.strip() for p in text.split(",") if p.strip()):
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise argparse.ArgumentTypeError(
                f"{part!r} is not a CPU or a range of CPUs (e.g. 0-3,8)"
            )
        cpus.update(range(int(low), int(high if dash else low) + 1))
    usable = os.sched_getaffinity(0)
    if not cpus or not cpus <= usable:
        raise argparse.ArgumentTypeError(
            f"{text!r}: not among the CPUs this process may use ({_cpu_list(usable)})"
        )
    return frozenset(cpus)


def _cpu_list(cpus: frozenset[int] | set[int]) -> str:
    return ",".join(map(str, sorted(cpus)))


def _lane_methods(text: str) -> tuple[str, ...]:
    methods = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in methods if m not in LANE_METHODS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"{', '.join(unknown)}: not a method a call lane carries "
            f"(one of {', '.join(LANE_METHODS)})"
        )
    return methods


def _factory_modules(values: list[str]) -> tuple[str, ...]:
    modules = [m.strip() for value in values for m in value.split(",") if m.strip()]
    for module in modules:
        if not all(part.isidentifier() for part in module.split(".")):
            raise argparse.ArgumentTypeError(f"--allow-factory {module!r} is not a module name")
    return tuple(modules)


def _factory_batching(text: str) -> Batching:
    """``--factory-batching ROWS[:MS]`` as a policy."""
    try:
        return Batching.parse(text)
    except InvalidArgument as exc:
        raise argparse.ArgumentTypeError(exc.message) from None


@dataclass(frozen=True)
class WorkerConfig:
    coordinator: str = setting(
        flag="--coordinator",
        required=True,
        parse=host_ports,
        metavar="H:P[,H:P...]",
        passed_on=False,
        help="coordinator address, or every address of an HA set (h1:p1,h2:p2,h3:p3): "
        "the worker talks to the first that answers and moves on when it goes away",
    )
    host: str = setting("127.0.0.1", flag="--host", passed_on=False, help="interface to bind")
    port: int = setting(
        0,
        flag="--port",
        parse=port_number,
        passed_on=False,
        shown_default="0, any free port",
        help="gRPC port",
    )
    # Empty: every visible CUDA device, else cpu.
    devices: tuple[str, ...] = setting(
        default_factory=tuple,
        flag="--devices",
        parse=parse_devices,
        to_text=",".join,
        metavar="LIST",
        passed_on=False,
        shown_default="every visible CUDA device, else cpu",
        help="comma-separated devices, e.g. cuda:0,cuda:1 or cpu",
    )
    cpus: frozenset[int] | None = setting(
        None,
        flag="--cpus",
        parse=parse_cpus,
        to_text=_cpu_list,
        metavar="LIST",
        passed_on=False,
        shown_default="every CPU the process may use",
        help="the CPUs every thread of this worker runs on, e.g. 0-3,8 (as taskset -c; torch's "
        "threads are as many unless OMP_NUM_THREADS says): workers sharing a host on cores "
        "of their own",
    )
    drain_timeout_s: float = setting(
        30.0,
        flag="--drain-timeout-s",
        parse=non_negative_float,
        metavar="S",
        help="on SIGTERM, a member first hands its rank and tensors to a live spare "
        "(a drain), waiting at most this long; 0: leave at once, as a crash would",
    )
    op_timeout_s: float | None = setting(
        None,
        flag="--op-timeout-s",
        parse=positive_float,
        metavar="S",
        passed_on=False,
        shown_default="the coordinator's --op-timeout-s",
        help="collective timeout, seconds",
    )
    queue_size: int = setting(
        1024,
        flag="--queue-size",
        parse=positive_int,
        metavar="N",
        help="bound of the leader's op queue; beyond it RESOURCE_EXHAUSTED",
    )
    flight_recorder_ops: int = setting(
        2000,
        flag="--flight-recorder-ops",
        parse=non_negative_int,
        metavar="N",
        help="ops the flight recorder keeps, each with its phase times (collectives trace, "
        "collectives diagnose); 0 turns it off",
    )
    max_tensor_bytes: int | None = setting(
        None,
        flag="--max-tensor-bytes",
        parse=byte_size,
        metavar="N",
        shown_default="unbounded",
        help="quota of each worker's tensor store (bytes, or e.g. 512MiB, 2GiB); puts and "
        "collective results beyond it answer RESOURCE_EXHAUSTED",
    )
    max_groups: int = setting(
        64,
        flag="--max-groups",
        parse=positive_int,
        metavar="N",
        help="sub-groups (new_group) one generation may hold (each gloo group costs every "
        "member ~5 file descriptors and ~3 threads); beyond it new_group answers "
        "RESOURCE_EXHAUSTED",
    )
    connect_timeout_s: float = setting(
        60.0,
        flag="--connect-timeout-s",
        parse=positive_float,
        metavar="S",
        help="how long to keep trying to reach the coordinator at start-up",
    )
    metrics_port: int | None = metrics_port_setting()
    metrics_host: str = metrics_host_setting()
    advertise_host: str | None = setting(
        None,
        flag="--advertise-host",
        metavar="H",
        passed_on=False,
        shown_default="--host, or the machine's name when --host is a wildcard",
        help="host name clients and peers use to reach this worker",
    )
    advertise_port: int | None = setting(
        None,
        flag="--advertise-port",
        parse=port_number,
        metavar="P",
        passed_on=False,
        shown_default="the bound port",
        help="port clients and peers use to reach this worker, when it differs from --port "
        "(a NAT or container port mapping)",
    )
    allow_factories: tuple[str, ...] = setting(
        default_factory=tuple,
        flag="--allow-factory",
        action="append",
        to_value=_factory_modules,
        metavar="MODULE",
        help="Python module whose functions may build models for "
        "load_model(factory='MODULE:fn'); repeat or comma-separate "
        "(e.g. collectives_server.model_zoo)",
    )
    graph_ttl_s: float = setting(
        60.0,
        flag="--graph-ttl-s",
        parse=positive_float,
        metavar="S",
        help="drop a forward's autograd graph if no backward comes within S seconds",
    )
    factory_batching: Batching | None = setting(
        None,
        flag="--factory-batching",
        parse=_factory_batching,
        to_text=lambda policy: f"{policy.max_rows}:{policy.max_delay_ms}",
        metavar="ROWS[:MS]",
        shown_default="no batching",
        help="merge concurrent no-grad forwards of models built by a factory (whose "
        "load_model names no batching) into one forward of up to ROWS rows, waiting at "
        "most MS milliseconds for company (e.g. 256:2)",
    )
    bulk: bool = setting(
        True,
        flag="--no-bulk",
        action="store_false",
        help="no bulk port: every payload goes through gRPC streams",
    )
    bulk_port: int = setting(
        0,
        flag="--bulk-port",
        parse=port_number,
        metavar="P",
        passed_on=False,
        shown_default="0, any free port",
        help="TCP port of the bulk data plane: large put/get payloads go over raw TCP, "
        "authorised by one-time tickets sent over gRPC; over TLS with the gRPC port's "
        "certificate when TLS is on",
    )
    call_lanes: bool = setting(
        True,
        flag="--no-call-lanes",
        action="store_false",
        help="serve no call lanes on the bulk port: every forward is a gRPC call "
        "(with --no-bulk there are none anyway)",
    )
    lane_methods: tuple[str, ...] | None = setting(
        None,
        flag="--lane-methods",
        parse=_lane_methods,
        to_text=",".join,
        metavar="NAMES",
        shown_default=f"every one a lane can carry: {','.join(LANE_METHODS)}",
        help="comma-separated Worker methods the call lanes carry; the others are gRPC calls",
    )
    shm_limits: ShmLimits = field(default_factory=ShmLimits)
    bulk_limits: BulkLimits = field(default_factory=BulkLimits)
    rpc_limits: RpcLimits = field(default_factory=RpcLimits)
    model_upload: ModelUploadConfig = field(default_factory=ModelUploadConfig)
    # TLS / mutual TLS / bearer token of this worker's gRPC server.
    security: ServerSecurity = field(default_factory=ServerSecurity)
    # How this worker reaches the coordinator (TLS, client certificate, token).
    coordinator_security: ChannelSecurity = PLAINTEXT
    # Sent as 'collectives-worker-token' on Register/Heartbeat/Leave (--worker-token-file).
    worker_token: str | None = None
