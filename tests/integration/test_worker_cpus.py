"""``collectives-server worker --cpus LIST``: every thread of the worker on those CPUs.

Workers sharing a host each on cores of their own, as each would have a GPU of its
own. The worker's collectives still give torch's answers there.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers import assert_tensor, get_each, put_each, reduce_oracle
from launcher import spawn

import collectives
from collectives_server.cli.main import build_parser

pytestmark = pytest.mark.timeout(120)


def _threads_cpus(pid: int) -> set[frozenset[int]]:
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found.add(frozenset(os.sched_getaffinity(int(task.name))))
        except ProcessLookupError:
            continue  # a thread that ended meanwhile
    return found


def test_every_thread_of_a_worker_runs_on_its_cpus(tmp_path: Path, gen) -> None:
    cpu = max(os.sched_getaffinity(0))
    coordinator = spawn(
        "coordinator", ["coordinator", "--world-size", "2", "--port", "0"], tmp_path / "c.log"
    )
    workers = []
    try:
        for i, cpus in enumerate((str(cpu), None)):
            args = ["worker", "--coordinator", coordinator.address, "--devices", "cpu"]
            workers.append(
                spawn(f"w{i}", args + (["--cpus", cpus] if cpus else []), tmp_path / f"w{i}.log")
            )
        with collectives.connect(coordinator.address, timeout=60) as cluster:
            inputs = [torch.randn(1000, generator=gen) for _ in range(2)]
            put_each(cluster, "x", inputs)
            cluster.all_reduce("x", timeout=60)  # gloo's and torch's threads started
            for rank, got in enumerate(get_each(cluster, "x")):
                assert_tensor(got, reduce_oracle("sum", inputs), what=f"rank {rank}")
        assert _threads_cpus(workers[0].pid) == {frozenset({cpu})}
        assert _threads_cpus(workers[1].pid) == {frozenset(os.sched_getaffinity(0))}
    finally:
        for daemon in (*workers, coordinator):
            daemon.stop()


@pytest.mark.parametrize("bad", ["x", "1-", "", "4096", "0-4096"])
def test_cpus_outside_this_process_s_are_refused_at_the_command_line(bad: str, capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker", "--coordinator", "h:1", "--cpus", bad])
    err = capsys.readouterr().err
    assert "--cpus" in err and ("not among" in err or "not a CPU" in err), err
