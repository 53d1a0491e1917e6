"""Settings declared once: the flags, ``local``'s children and the config agree by construction.

A worker setting is one field of ``WorkerConfig``; these tests walk every
declared field, so a new one is covered without a line here.
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from collectives.wire.batching import Batching
from collectives_server.cli.coordinator import config_from_args as coordinator_config
from collectives_server.cli.local import coordinator_config_from_args, worker_config_from_args
from collectives_server.cli.main import build_parser
from collectives_server.cli.worker import config_from_args
from collectives_server.coordinator.daemon import CoordinatorConfig
from collectives_server.local import LocalCluster
from collectives_server.settings import Flag, add_flags, flag_rows, from_flags, setting, to_argv
from collectives_server.worker.config import WorkerConfig

# A value other than the default for every setting ``local`` passes on, by flag.
_OTHER = {
    "--queue-size": 7,
    "--flight-recorder-ops": 0,
    "--max-tensor-bytes": 3 << 20,
    "--max-groups": 5,
    "--connect-timeout-s": 2.5,
    "--drain-timeout-s": 12.5,
    "--allow-factory": ("collectives_server.model_zoo", "json"),
    "--graph-ttl-s": 9.0,
    "--factory-batching": Batching(max_rows=16, max_delay_ms=1.5),
    "--no-bulk": False,
    "--no-call-lanes": False,
    "--lane-methods": ("Forward", "AllReduce"),
    "--shm-max-segments": 3,
    "--shm-max-bytes": 5 << 20,
    "--shm-segment-ttl-s": 4.0,
    "--bulk-ticket-ttl-s": 6.0,
    "--bulk-prelude-timeout-s": 1.5,
    "--bulk-idle-s": 7.0,
    "--max-bulk-connections": 9,
    "--max-bulk-connections-per-peer": 2,
    "--max-rpc-s": 11.0,
    "--stream-idle-s": 3.0,
    "--max-data-streams": 12,
    "--max-data-streams-per-peer": 4,
    "--allow-model-upload": True,
    "--max-model-bytes": 1 << 20,
    "--max-model-entries": 17,
    "--max-model-json-bytes": 1 << 16,
    "--model-upload-dir": "/tmp/uploads",
    "--load-sandbox": False,
    "--model-load-timeout-s": 8.0,
}


def _declared(passed_on: bool | None = True) -> dict[str, str]:
    """Flag → field path of WorkerConfig's settings."""
    found = {}
    for flags, _default, _help in flag_rows(WorkerConfig, passed_on=passed_on):
        found[flags.split(" / ")[0]] = flags
    return found


def _paths() -> dict[str, str]:
    """Flag → dotted field path, read from the declarations."""
    paths: dict[str, str] = {}

    def walk(cls: type, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            flag = f.metadata.get("collectives.flag")
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
            if isinstance(flag, Flag):
                paths[flag.names[0]] = prefix + f.name
            elif dataclasses.is_dataclass(default):
                walk(type(default), f"{prefix}{f.name}.")

    walk(WorkerConfig, "")
    return paths


def _at(config: object, path: str) -> object:
    for part in path.split("."):
        config = getattr(config, part)
    return config


def _config_with_others() -> WorkerConfig:
    paths = _paths()
    values = {paths[flag]: value for flag, value in _OTHER.items()}
    return from_flags(WorkerConfig, argparse.Namespace(), {"coordinator": "", **values})


def test_every_setting_local_passes_on_has_a_value_here() -> None:
    assert set(_declared()) == set(_OTHER), "give the new setting a non-default value in _OTHER"
    for flag, value in _OTHER.items():
        assert _at(WorkerConfig(coordinator=""), _paths()[flag]) != value, flag


def test_a_config_survives_its_own_flags_through_a_worker() -> None:
    sent = dataclasses.replace(_config_with_others(), coordinator="127.0.0.1:5")
    argv = to_argv(sent, passed_on=None)
    got = config_from_args(build_parser().parse_args(["worker", *argv]))
    for path in _paths().values():
        assert _at(got, path) == _at(sent, path), path


@pytest.mark.parametrize("flag", sorted(_OTHER))
def test_local_takes_each_setting_it_passes_on(flag: str) -> None:
    sent = _config_with_others()
    path = _paths()[flag]
    argv = [a for a in to_argv(sent) if a.split("=")[0] in (flag, "--no-" + flag[2:])]
    assert argv, f"{flag} is not in the flags of a non-default value"
    args = build_parser().parse_args(["local", "--workers", "2", *argv])
    assert _at(worker_config_from_args(args), path) == _at(sent, path)


def test_local_does_not_offer_a_workers_identity() -> None:
    # (local's own --host and --port are the coordinator's, and its workers bind --host.)
    for flag in ("--coordinator", "--bulk-port", "--advertise-host", "--advertise-port"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["local", "--workers", "1", f"{flag}=1"])


def test_local_cluster_starts_each_worker_with_the_config_it_was_given() -> None:
    given = _config_with_others()
    coordinator = CoordinatorConfig(min_workers=1, max_workers=1, host="127.0.0.2")
    cluster = LocalCluster(2, coordinator_config=coordinator, worker_config=given, devices="cpu")
    for slot in (0, 1):
        config = cluster.worker_config(slot, "127.0.0.2:9")
        assert (config.coordinator, config.host, config.devices) == (
            "127.0.0.2:9",
            "127.0.0.2",
            ("cpu",),
        )
        assert dataclasses.replace(config, coordinator="", host="127.0.0.1", devices=()) == given


def test_defaults_give_no_flags_but_the_resolved_switches() -> None:
    assert to_argv(WorkerConfig(coordinator="")) == ["--no-allow-model-upload", "--load-sandbox"]


def test_the_help_shows_each_default_once() -> None:
    help_text = build_parser()._subparsers._group_actions[0].choices["worker"].format_help()  # type: ignore[union-attr]
    for flags, default, _ in flag_rows(WorkerConfig):
        name = flags.split(" / ")[0]
        assert name in help_text
        if default != "-":
            assert f"(default: {default.split()[0]}" in " ".join(help_text.split()), name


def test_a_new_setting_is_one_field() -> None:
    @dataclasses.dataclass(frozen=True)
    class Inner:
        depth: int = setting(3, flag="--depth", parse=int, help="how deep")

    @dataclasses.dataclass(frozen=True)
    class Outer:
        name: str = setting("x", flag="--name", help="what", passed_on=False)
        inner: Inner = dataclasses.field(default_factory=Inner)

    parser = argparse.ArgumentParser()
    add_flags(parser, Outer)
    built = from_flags(Outer, parser.parse_args(["--depth", "5", "--name", "y"]))
    assert built == Outer(name="y", inner=Inner(depth=5))
    assert to_argv(built, passed_on=None) == ["--name=y", "--depth=5"]
    assert to_argv(built) == ["--depth=5"]
    assert flag_rows(Outer) == [("--name", "x", "what"), ("--depth", "3", "how deep")]


_OTHER_COORDINATOR = {
    "host": "127.0.0.3",
    "port": 4711,
    "heartbeat_s": 0.25,
    "lease_s": 2.0,
    "join_window_s": 0.0,
    "drain_prepare_s": 0.25,
    "op_timeout_s": 7.0,
    "advertise_host": "coordinator.example",
    "dashboard_port": 0,
    "dashboard_host": "127.0.0.4",
    "metrics_port": 9100,
    "metrics_host": "127.0.0.5",
    "limits.max_waiting_workers": 3,
    "limits.max_watch_streams": 5,
    "limits.max_watch_streams_per_peer": 2,
    "dashboard_idle_s": 4.0,
    "dashboard_max_connections": 6,
    "store": "etcd://127.0.0.1:2379",
    "cluster_name": "blue",
    "leader_ttl_s": 5,
}


def _coordinator_with_others() -> CoordinatorConfig:
    size = {"min_workers": 2, "max_workers": 3}
    return from_flags(CoordinatorConfig, argparse.Namespace(), {**size, **_OTHER_COORDINATOR})


def test_every_coordinator_setting_has_a_value_here() -> None:
    declared = {row[0].split(" / ")[0] for row in flag_rows(CoordinatorConfig)}
    assert len(declared) == len(_OTHER_COORDINATOR), "give the new setting a value here"
    default = CoordinatorConfig(min_workers=1, max_workers=1)
    for path, value in _OTHER_COORDINATOR.items():
        assert _at(default, path) != value, path


def test_a_coordinator_config_survives_its_own_flags() -> None:
    sent = _coordinator_with_others()
    argv = ["--min-workers=2", "--max-workers=3", *to_argv(sent, passed_on=None)]
    args = build_parser().parse_args(["coordinator", *argv])
    assert coordinator_config(args, args.parser) == sent


def test_local_takes_each_coordinator_setting_it_passes_on() -> None:
    sent = dataclasses.replace(_coordinator_with_others(), min_workers=2, max_workers=2)
    args = build_parser().parse_args(["local", "--workers", "2", *to_argv(sent)])
    got = coordinator_config_from_args(args)
    # Not offered by local: its own metrics ports, and what only a deployment sets.
    own = (
        "advertise_host",
        "metrics_port",
        "metrics_host",
        "store",
        "cluster_name",
        "leader_ttl_s",
    )
    for path in _OTHER_COORDINATOR:
        expected = _at(
            CoordinatorConfig(min_workers=1, max_workers=1) if path in own else sent, path
        )
        assert _at(got, path) == expected, path
