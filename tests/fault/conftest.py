"""Fault suite: real processes, real signals; prints time to detect and recover per fault."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from error_fields import field_problems, recording_errors
from harness import FAULT_DAEMONS, LEASE_S, OP_TIMEOUT_S, RESULTS, SOAK_LINES, FaultCluster
from helpers import internal_lines

# How much of each daemon's log a failed test shows (its last lines).
LOG_TAIL_LINES = 40


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test shows the tails of the logs of the daemons it started: the logs
    live in the session's temporary directory, gone with a CI machine."""
    outcome = yield
    report = outcome.get_result()
    first = getattr(item, "_first_daemon_log", None)
    if report.failed and first is not None:
        for daemon in FAULT_DAEMONS[first:]:
            report.sections.append(
                (f"daemon log {daemon.log_path.name}", daemon.log_tail(LOG_TAIL_LINES))
            )


@pytest.fixture(autouse=True)
def _note_first_daemon_log(request) -> Iterator[None]:
    request.node._first_daemon_log = len(FAULT_DAEMONS)
    rows, lines = len(RESULTS), len(SOAK_LINES)
    yield
    # The rows travel with the test's report, so that the process that prints the
    # summary (pytest-xdist's controller) has them too.
    for row in RESULTS[rows:]:
        request.node.user_properties.append(("fault_row", row))
    for line in SOAK_LINES[lines:]:
        request.node.user_properties.append(("soak_line", line))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """In pytest-xdist's controller: the rows its workers' tests recorded."""
    if report.when != "teardown" or not hasattr(report, "node"):
        return  # run here (no xdist, or an xdist worker): the lists are filled already
    for key, value in report.user_properties:
        if key == "fault_row":
            RESULTS.append(value)
        elif key == "soak_line":
            SOAK_LINES.append(value)


def pytest_terminal_summary(terminalreporter) -> None:
    tr = terminalreporter
    if SOAK_LINES:
        tr.section("soak: mixed ops from 8 clients while workers are killed and replaced")
        for line in SOAK_LINES:
            tr.write_line(line)
    if not RESULTS:
        return
    tr.section("fault injection: time to detect and to recover")
    tr.write_line(f"{'fault':<34} {'detect s':>9} {'recover s':>10}  note")
    for row in RESULTS:
        tr.write_line(
            f"{row['fault']:<34} {row['detect_s']:>9.2f} {row['recover_s']:>10.2f}  {row['note']}"
        )


@pytest.fixture
def fault_cluster():
    clusters: list[FaultCluster] = []

    def start(
        workers: int = 3,
        min_workers: int = 2,
        max_workers: int | None = None,
        worker_args: tuple[str, ...] = (),
        lease_s: float = LEASE_S,
        each_worker_args: tuple[tuple[str, ...], ...] = (),
        op_timeout_s: float = OP_TIMEOUT_S,
    ):
        cluster = FaultCluster(
            workers, min_workers, max_workers, worker_args, lease_s, each_worker_args, op_timeout_s
        )
        clusters.append(cluster)
        return cluster

    yield start
    for cluster in clusters:
        cluster.close()


@pytest.fixture(scope="session", autouse=True)
def no_daemon_logs_internal():
    """INTERNAL means a bug of ours: no daemon of the fault suite may log one,
    whatever was killed, stopped or cut under it."""
    yield
    found = [line for daemon in FAULT_DAEMONS for line in internal_lines(daemon.log_path)]
    assert not found, "daemons logged INTERNAL:\n" + "\n".join(found[:120])


@pytest.fixture(autouse=True)
def _errors_carry_their_fields() -> Iterator[None]:
    """Every error a test provokes names what the server knows (tests/error_fields.py)."""
    with recording_errors() as made:
        yield
    problems = {f"{err!r}: {why}" for err in made for why in field_problems(err)}
    assert not problems, "errors with incomplete fields:\n" + "\n".join(sorted(problems))
