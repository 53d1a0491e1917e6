"""bench/core.py and the entry point's table, without a cluster (fast)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import __main__ as entry
from bench.anchors import TcpSink, percentile
from bench.core import Row, Stat, measure, stat_of


def _stat(median: float, unit: str = "GB/s") -> Stat:
    return Stat(median, median, median, unit, 1)


def test_ratio_is_service_over_anchor() -> None:
    row = Row("g", "w", _stat(1.5), "a", _stat(3.0))
    assert row.ratio == pytest.approx(0.5)


def test_ratio_is_nan_when_anchor_is_zero() -> None:
    row = Row("g", "w", _stat(1.0), "a", _stat(0.0))
    assert math.isnan(row.ratio)
    assert entry._ratio(row) == "n/a"


@pytest.mark.parametrize(
    ("service", "anchor", "target", "met"),
    [
        (0.6, 1.0, ">= 0.6", True),  # the bound itself meets a >= target
        (0.59, 1.0, ">= 0.6", False),
        (1.0, 1.0, "<= 1.0", True),
        (1.01, 1.0, "<= 1.0", False),
        (1.2, 1.0, "<= 1.3", True),
        (5.0, 1.0, "", None),  # no target
    ],
)
def test_met(service: float, anchor: float, target: str, met: bool | None) -> None:
    row = Row("g", "w", _stat(service), "a", _stat(anchor), target=target)
    assert row.met() is met
    d = row.as_dict()
    assert d["met"] is met
    assert d["ratio"] == pytest.approx(service / anchor)


def test_measure_counts_warmup_and_repeats() -> None:
    calls = []
    stat = measure(lambda: calls.append(1), 7, warmup=2)
    assert len(calls) == 9
    assert stat.samples == 7
    assert stat.unit == "s"
    assert stat.low <= stat.median <= stat.high


def test_measure_per_converts_units() -> None:
    stat = measure(lambda: None, 3, warmup=0, unit="GB/s", per=lambda s: 1.0)
    assert (stat.median, stat.low, stat.high, stat.samples) == (1.0, 1.0, 1.0, 3)


def test_stat_of_and_text() -> None:
    stat = stat_of([3.0, 1.0, 2.0], "ms")
    assert (stat.median, stat.low, stat.high, stat.samples) == (2.0, 1.0, 3.0, 3)
    assert stat.text() == "2 ms (p99 3, worst 3)"
    # Times are shown in a unit scaled to the median; rates keep theirs, worst = lowest.
    assert stat_of([7.65e-05, 8e-05, 9e-05], "s").text() == "80 µs (p99 90, worst 90)"
    rates = stat_of([float(v) for v in range(1, 201)], "GB/s")
    assert rates.p99 == 3.0 and rates.worst == 1.0 and rates.text().startswith("100 GB/s")


def test_terminal_table_fits_120_columns() -> None:
    long = "x" * 150
    rows = [
        Row("1 put/get", long, stat_of([0.5, 0.6, 0.7], "GB/s"), long, _stat(1.0), ">= 0.6"),
        Row("4 latency", "all_reduce 4 B", stat_of([1e-3, 2e-3], "s"), "rtt", _stat(1e-3, "s")),
    ]
    lines = entry.terminal_table(rows).splitlines()
    assert len(lines) == 3 and max(map(len, lines)) <= 120
    assert "GB/s" in lines[1] and "ms" in lines[2] and "e-0" not in "".join(lines)


def test_percentile() -> None:
    values = [float(i) for i in range(1, 101)]
    assert percentile(values, 50) in (50.0, 51.0)
    assert percentile(values, 99) == 99.0
    assert percentile(values, 100) == 100.0
    assert percentile([4.0], 99) == 4.0


def test_markdown_table_one_line_per_row_and_escapes_pipes() -> None:
    rows = [
        Row("1 put/get", "put 1 MiB", _stat(0.5), "raw TCP | prealloc", _stat(1.0), ">= 0.6"),
        Row("4 latency", "p50", _stat(1.0, "ms"), "rtt", _stat(2.0, "ms"), "<= 1.0"),
    ]
    table = entry.markdown_table(rows).splitlines()
    assert len(table) == 2 + len(rows)
    assert table[0].count("|") == len(entry.COLUMNS) + 1
    assert "raw TCP \\| prealloc" in table[2]
    assert table[2].endswith("| >= 0.6 | **no** |")
    assert table[3].endswith("| <= 1.0 | yes |")


def test_discover_orders_rows_like_the_issue() -> None:
    names = entry.discover()
    assert {"putget", "latency", "memory"} <= set(names)
    assert names.index("putget") < names.index("latency") < names.index("memory")


def test_a_failing_row_is_reported_and_the_others_run(monkeypatch, tmp_path) -> None:
    good = Row("g", "ok", _stat(1.0), "a", _stat(1.0), "<= 1.0")
    modules = {
        "bench.row_good": type(sys)("bench.row_good"),
        "bench.row_bad": type(sys)("bench.row_bad"),
    }
    modules["bench.row_good"].run = lambda ctx: [good]

    def bad(ctx):
        raise RuntimeError("boom")

    modules["bench.row_bad"].run = bad
    monkeypatch.setattr(entry, "discover", lambda: ["bad", "good"])
    monkeypatch.setattr(entry.importlib, "import_module", lambda name: modules[name])
    out_json, out_md = tmp_path / "b.json", tmp_path / "b.md"
    rc = entry.main(["--quick", "--json", str(out_json), "--markdown", str(out_md)])
    assert rc == 1
    doc = json.loads(out_json.read_text())
    assert [r["what"] for r in doc["rows"]] == ["ok"]
    assert "bad" in doc["failures"] and "boom" in doc["failures"]["bad"]
    assert doc["mode"] == "quick"
    assert "| ok |" in out_md.read_text()


def test_tcp_sink_round_trip() -> None:
    torch = pytest.importorskip("torch")
    with TcpSink(1 << 20) as sink:
        stat = sink.gbps(torch.ones(1 << 18), 2)  # 1 MiB
    assert stat.samples == 2 and stat.median > 0


def test_discover_lists_the_publish_row() -> None:
    assert "publish" in entry.discover()


def test_publish_anchor_sums_the_parts_order_statistics() -> None:
    from bench.sent_once import summed

    put, bcast = [0.3, 0.1, 0.2, 1.0], [0.05, 0.04, 0.06]
    assert summed(put, bcast) == pytest.approx([0.14, 0.25, 0.36])
    stat = stat_of(summed([0.1, 0.2, 0.3], [1.0, 3.0, 2.0]), "s")
    assert (stat.median, stat.high) == pytest.approx((2.2, 3.3))


SS_SAMPLE = """\
LISTEN 0 4096 127.0.0.1:40000 0.0.0.0:* ino:11 sk:1 cgroup:/ <->
ESTAB 0 0 127.0.0.1:5000 127.0.0.1:6000 ino:12 sk:2 cgroup:/ <->
\t ts sack cubic wscale:7,7 rto:204 bytes_sent:101 bytes_acked:100 bytes_received:7 segs_out:3
ESTAB 0 0 [::ffff:127.0.0.1]:5001 [::ffff:127.0.0.1]:6001 ino:13 sk:3 cgroup:/ <->
\t ts sack cubic wscale:7,7 rto:204 bytes_acked:1 segs_out:1
TIME-WAIT 0 0 127.0.0.1:5002 127.0.0.1:6002 timer:(timewait,57sec,0) ino:0 sk:4
\t
"""


def test_parse_ss_reads_bytes_acked_per_inode() -> None:
    from bench.egress import parse_ss

    assert parse_ss(SS_SAMPLE) == {11: 0, 12: 100, 13: 1, 0: 0}


def test_tcp_egress_counts_this_process_sockets() -> None:
    import socket
    import threading

    from bench import egress

    if not egress.available():
        pytest.skip("needs ss and /proc")
    nbytes = 3_000_000

    def serve(conn: socket.socket) -> None:
        got = 0
        while got < nbytes:
            got += len(conn.recv(1 << 20))
        conn.sendall(b"\x01")  # its segment acks every byte received

    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
        with client, server:
            counter = egress.TcpEgress()
            counter.start()
            thread = threading.Thread(target=serve, args=(server,))
            thread.start()
            client.sendall(b"x" * nbytes)
            assert client.recv(1) == b"\x01"
            thread.join(30)
            count = counter.stop()
    # The server's 1-byte answer is this process's too (acked, or not yet: delayed ACK).
    assert nbytes <= count.nbytes <= nbytes + 1
    assert count.closed == 0
