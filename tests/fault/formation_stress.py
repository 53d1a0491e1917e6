"""Forms clusters over and over and checks that one generation names one membership.

Each formation starts its own coordinators (one on the memory store, or three on
a real etcd, every one reachable by the workers), then three workers at random
offsets around the join window: before it ends, inside it, at its edge, and late
enough that the cluster first forms without one of them. The coordinators take
``--min-workers 2 --max-workers 3``, so the third worker either makes the first
generation or joins the next one.

Once the coordinator reports every live worker a member and every member joined,
the formation is checked:

(a) each worker's own generation (asked over gRPC: ``GetState``) has the
    coordinator's generation, world size, the worker's rank and the
    coordinator's membership digest;
(b) an ``all_reduce(sum)`` of distinct random inputs, one per rank the client
    sees, equals what torch computes over exactly those ranks.

Run by ``test_formation_stress.py`` (a bounded number of formations) and, for
hundreds, as a script::

    .venv/bin/python tests/fault/formation_stress.py --store etcd --formations 200
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import TIMING_FLAGS
from helpers import wait_until
from launcher import Daemon, log_dir, server_argv

import collectives
from collectives.v1 import worker_pb2, worker_pb2_grpc
from collectives.wire.cluster_state import ClusterSnapshot

JOIN_WINDOW_S = 0.5
MIN_WORKERS = 2
MAX_WORKERS = 3
# Start offsets of the workers, in join windows after the first: where the
# third lands decides whether it makes the first generation or the next one.
OFFSET_CHOICES = (0.0, 0.2, 0.5, 0.9, 1.0, 1.1, 1.5, 2.5, 4.0)
FORM_TIMEOUT_S = 30.0


@dataclass
class FormationResult:
    store: str
    offsets: tuple[float, ...]
    generation: int = 0
    world_size: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _begin(name: str, args: list[str], log: Path) -> Daemon:
    """``collectives-server ARGS`` started (its address not yet awaited), logging to ``log``."""
    daemon = Daemon(name, server_argv(*args, "--log-level", "INFO"), log)
    daemon.begin()
    return daemon


class Formation:
    """One formation: coordinators, three workers at ``offsets``, the checks, teardown."""

    def __init__(self, store: str, offsets: tuple[float, ...], etcd_url: str = "") -> None:
        self.log = log_dir() / f"formation-{uuid.uuid4().hex[:12]}.log"
        self.store = store
        self.offsets = offsets
        self.etcd_url = etcd_url
        self.coordinators: list[Daemon] = []
        self.workers: list[Daemon] = []
        self.addresses: list[str] = []

    def run(self) -> FormationResult:
        result = FormationResult(self.store, self.offsets)
        client = None
        try:
            self._start_coordinators()
            self._start_workers()
            client = collectives.connect(",".join(self.addresses), timeout=FORM_TIMEOUT_S)
            try:
                snapshot = self._wait_formed(client)
            except AssertionError as exc:
                # Not ready in time: still check what the client sees, as a user would.
                result.problems.append(str(exc))
                snapshot = client.snapshot()
            result.generation, result.world_size = snapshot.generation, snapshot.world_size
            result.problems += self._check_workers(snapshot)
            result.problems += self._check_all_reduce(client, snapshot)
        except Exception as exc:  # a formation that fails to form is a failure too
            result.problems.append(f"{type(exc).__name__}: {exc}")
        finally:
            if client is not None:
                client.close()
            if result.problems:  # what the daemons said, for the diagnosis
                logged = self.log.read_text(errors="replace").splitlines()
                result.problems += [f"log: {line}" for line in logged[-60:]]
            self.close()
        return result

    # ---- processes ---------------------------------------------------------------

    def _coordinator_args(self, cluster_name: str) -> list[str]:
        args = [
            "coordinator",
            "--port",
            "0",
            "--min-workers",
            str(MIN_WORKERS),
            "--max-workers",
            str(MAX_WORKERS),
            "--join-window-s",
            str(JOIN_WINDOW_S),
            *TIMING_FLAGS,
        ]
        if self.store == "etcd":
            args += ["--store", self.etcd_url, "--cluster-name", cluster_name]
            args += ["--leader-ttl-s", "2"]
        return args

    def _start_coordinators(self) -> None:
        count = 3 if self.store == "etcd" else 1
        name = f"stress-{uuid.uuid4().hex[:12]}"
        self.coordinators = [
            _begin(f"coordinator-{i}", self._coordinator_args(name), self.log) for i in range(count)
        ]
        self.addresses = [d.wait_address(60.0) for d in self.coordinators]
        if self.store == "etcd":
            wait_until(self._leader_elected, 20.0, "a coordinator to lead")

    def _leader_elected(self) -> bool:
        from ha_harness import cluster_of

        leaders = set()
        for address in self.addresses:
            try:
                leaders.add(cluster_of(address).leader)
            except grpc.RpcError:
                return False
        return len(leaders) == 1 and "" not in leaders

    def _start_workers(self) -> None:
        """Starts each worker at its offset; each gets the coordinator list rotated,
        so with etcd the workers first dial different coordinators (leader and standbys)."""
        started = time.monotonic()
        self.workers = []
        for i, offset in enumerate(self.offsets):
            start_at = started + offset * JOIN_WINDOW_S
            while (delay := start_at - time.monotonic()) > 0:  # the schedule itself, not a wait
                time.sleep(delay)
            rotated = (
                self.addresses[i % len(self.addresses) :]
                + self.addresses[: i % len(self.addresses)]
            )
            args = ["worker", "--coordinator", ",".join(rotated)]
            self.workers.append(_begin(f"worker-{i}", args, self.log))
        for worker in self.workers:
            worker.wait_address(60.0)

    def close(self) -> None:
        for d in [*self.workers, *self.coordinators]:
            d.stop()
        self.workers, self.coordinators = [], []
        self.log.unlink(missing_ok=True)

    # ---- checks ------------------------------------------------------------------

    def _wait_formed(self, client: collectives.Cluster) -> ClusterSnapshot:
        """The snapshot once every live worker is a member and every member joined."""

        def formed():
            s = client.snapshot()
            live = [w for w in s.workers if w.state != "lost"]
            if s.formed and s.ready and s.world_size == len(live) == MAX_WORKERS:
                return s
            return None

        return wait_until(formed, FORM_TIMEOUT_S, "all three workers members of a ready generation")

    def _check_workers(self, snapshot: ClusterSnapshot) -> list[str]:
        problems = []
        for member in snapshot.members:
            with grpc.insecure_channel(member.address) as channel:
                state = worker_pb2_grpc.WorkerStub(channel).GetState(
                    worker_pb2.GetStateRequest(), timeout=10
                )
            seen = (state.generation, state.rank, state.world_size, state.membership_digest)
            want = (
                snapshot.generation,
                member.rank,
                snapshot.world_size,
                snapshot.membership_digest,
            )
            if seen != want:
                problems.append(
                    f"{member.worker_id} at {member.address} holds (generation, rank, world "
                    f"size, digest) {seen}; the coordinator says {want}"
                )
        return problems

    def _check_all_reduce(
        self, client: collectives.Cluster, snapshot: ClusterSnapshot
    ) -> list[str]:
        gen = torch.Generator().manual_seed(random.getrandbits(31))
        inputs = [torch.randn(20, generator=gen) for _ in range(client.world_size)]
        for rank, tensor in enumerate(inputs):
            client.put("stress/x", tensor, rank=rank)
        client.all_reduce("stress/x", op="sum")
        want = torch.stack(inputs).sum(dim=0)
        problems = []
        for rank in range(client.world_size):
            got = client.get("stress/x", rank=rank)
            if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
                problems.append(
                    f"all_reduce(sum) on rank {rank} of generation {snapshot.generation} "
                    f"differs from torch's sum over ranks 0..{client.world_size - 1} "
                    f"(max error {(got - want).abs().max().item():.3g})"
                )
        return problems


def random_offsets(rng: random.Random) -> tuple[float, ...]:
    """The first worker at 0, the others anywhere around the join window."""
    return (0.0, *sorted(rng.choice(OFFSET_CHOICES) for _ in range(MAX_WORKERS - 1)))


# One formation of each kind: all at once (max_workers at once), the third inside
# the window, at its edge, just after it, and long after (the next generation).
EVERY_KIND = (
    (0.0, 0.0, 0.0),
    (0.0, 0.2, 0.5),
    (0.0, 0.5, 1.0),
    (0.0, 0.2, 1.1),
    (0.0, 0.9, 1.5),
    (0.0, 0.0, 4.0),
)


def run_formations(
    store: str, offsets: list[tuple[float, ...]], etcd_url: str = "", report=print
) -> list[FormationResult]:
    results = []
    count = len(offsets)
    for i, start_offsets in enumerate(offsets):
        result = Formation(store, start_offsets, etcd_url).run()
        results.append(result)
        mark = "ok  " if result.ok else "FAIL"
        report(
            f"{mark} formation {i + 1}/{count} ({store}, offsets {result.offsets}): generation "
            f"{result.generation}, world {result.world_size}"
            + "".join(f"\n     {p}" for p in result.problems)
        )
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", choices=("memory", "etcd"), default="memory")
    parser.add_argument("--formations", type=int, default=20)
    parser.add_argument("--seed", type=int, default=int(time.time()))
    args = parser.parse_args()
    etcd = None
    etcd_url = ""
    if args.store == "etcd":
        import tempfile

        from etcd_server import EtcdServer

        etcd = EtcdServer(Path(tempfile.mkdtemp()) / "etcd")
        etcd_url = etcd.url
    try:
        rng = random.Random(args.seed)
        offsets = [random_offsets(rng) for _ in range(args.formations)]
        results = run_formations(args.store, offsets, etcd_url)
    finally:
        if etcd is not None:
            etcd.stop()
    failed = sum(not r.ok for r in results)
    correct = len(results) - failed
    print(f"{args.store}: {correct} of {len(results)} formations correct, {failed} wrong")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
