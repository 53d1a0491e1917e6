"""``collectives-server`` argument handling and the local launcher's device split (no daemons)."""

from __future__ import annotations

import pytest

from collectives_server.cli.coordinator import config_from_args as coordinator_config
from collectives_server.cli.main import build_parser
from collectives_server.cli.worker import config_from_args as worker_config
from collectives_server.coordinator import CoordinatorConfig
from collectives_server.local import assign_devices


def coordinator(*argv: str) -> CoordinatorConfig:
    args = build_parser().parse_args(["coordinator", *argv])
    return coordinator_config(args, args.parser)


def test_world_size_means_min_and_max() -> None:
    config = coordinator("--world-size", "3", "--port", "0", "--lease", "2", "--heartbeat", "0.5")
    assert (config.min_workers, config.max_workers) == (3, 3)
    assert (config.lease_s, config.heartbeat_s, config.port) == (2.0, 0.5, 0)
    config = coordinator("--min-workers", "2", "--max-workers", "4", "--op-timeout-s", "5")
    assert (config.min_workers, config.max_workers, config.op_timeout_s) == (2, 4, 5.0)
    assert coordinator("--min-workers", "2").max_workers == 2
    assert coordinator("--max-workers", "3").min_workers == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "cluster size is required"),
        (["--world-size", "2", "--min-workers", "1"], "not both"),
        (["--min-workers", "3", "--max-workers", "2"], "max_workers (2) must be >= min_workers"),
        (["--world-size", "0"], "must be >= 1"),
        (["--world-size", "2", "--lease", "1", "--heartbeat", "1"], "lease_s (1.0) must be longer"),
        (["--world-size", "2", "--port", "70000"], "0..65535"),
    ],
)
def test_coordinator_argument_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        coordinator(*argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_worker_arguments_build_worker_config(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(
        ["worker", "--coordinator", "10.0.0.1:50051", "--devices", "cuda:0, cuda:1"]
    )
    config = worker_config(args)
    assert config.coordinator == "10.0.0.1:50051"
    assert config.devices == ("cuda:0", "cuda:1")
    assert (config.host, config.port, config.op_timeout_s, config.queue_size) == (
        "127.0.0.1",
        0,
        None,
        1024,
    )
    for bad in (["--coordinator", "nohost"], ["--coordinator", "h:1", "--devices", "tpu:0"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["worker", *bad])
    assert "HOST:PORT" in capsys.readouterr().err


def test_local_devices_split() -> None:
    assert assign_devices(2, "cpu", lambda: 8) == [("cpu",), ("cpu",)]
    assert assign_devices(2, "auto", lambda: 0) == [("cpu",), ("cpu",)]
    assert assign_devices(3, "auto", lambda: 2) == [("cpu",)] * 3  # NCCL: one GPU per rank
    assert assign_devices(2, "auto", lambda: 4) == [("cuda:0", "cuda:1"), ("cuda:2", "cuda:3")]
    assert assign_devices(2, "cuda:3,cuda:5", lambda: 0) == [("cuda:3",), ("cuda:5",)]
    with pytest.raises(ValueError, match="one per worker"):
        assign_devices(3, "cuda:0,cuda:1", lambda: 2)
