"""The tables of ``collectives status`` and ``collectives top``, fitted to the terminal.

A table keeps every column when it fits the width (``COLUMNS`` or the
terminal's, 80 when unknown); otherwise it drops the least useful columns
first, in a fixed order, and says how many it hid (``--wide`` keeps them all).
Header, status and error lines are cut to the width with an ellipsis.

Both show the failed ops grouped by kind, code and message (one line per group
with its count, first and last time, rate and the client that issued it), and
``top`` adds a table by op kind: the cluster's row (``all``), then each
worker's, with the rate and latency p50/p99 the workers report (so the first
frame already has them) and the collective bytes each moved.

The status table's MODELS column shows each hosted model as ``name@vN`` (its
version); a model a worker serves at an older version than another live worker
is marked ``*`` there and named on a ``lagging models`` line under the table,
which shows even when the column is hidden.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Container, Sequence

from collectives.wire.cluster_state import ClusterSnapshot, OpCount, WorkerInfo, WorkerState

__all__ = [
    "format_table",
    "format_top",
    "human_bytes",
    "batch_rows",
    "kind_rows",
    "lagging_models",
    "models_cell",
    "rates_between",
    "terminal_width",
]

STATUS_COLUMNS = (
    "RANK", "STATE", "ADDRESS", "HOSTNAME", "PID", "DEVICES", "JOINED_GEN", "HEARTBEAT",
    "TENSORS", "MODELS", "OPS_OK", "OPS_FAILED", "QUEUE", "MEMORY", "LAST_OP",
)  # fmt: skip
# Dropped first to last when the table is too wide.
STATUS_DROP_ORDER = (
    "HOSTNAME", "DEVICES", "JOINED_GEN", "MEMORY", "HEARTBEAT", "MODELS", "PID", "OPS_FAILED",
    "QUEUE", "LAST_OP",
)  # fmt: skip
# The MODELS cell lists models while it stays this short, then says how many more.
MODELS_CELL_CHARS = 32
# Marks a model whose version is behind the newest a live worker reports.
LAGGING_MARK = "*"
TOP_COLUMNS = (
    "RANK", "STATE", "ADDRESS", "OPS/S", "OPS_OK", "OPS_FAILED", "QUEUE", "MEMORY", "TENSORS",
    "LAST_OP", "LATENCY",
)  # fmt: skip
TOP_DROP_ORDER = ("MEMORY", "OPS_FAILED", "QUEUE", "LAST_OP", "OPS_OK", "TENSORS")
KIND_COLUMNS = ("KIND", "RANK", "OPS/S", "OK", "FAILED", "P50", "P99", "COLL_IN", "COLL_OUT")
KIND_DROP_ORDER = ("COLL_IN", "COLL_OUT", "FAILED", "OK")
# Models loaded with batching, per worker: what their dynamic batchers merged.
BATCH_COLUMNS = ("MODEL", "RANK", "FORWARDS", "ROWS", "ROWS/FWD")
BATCH_DROP_ORDER = ("ROWS", "FORWARDS")
# Error groups and clients shown under the tables.
ERROR_LINES = 5
CLIENT_LINES = 5
WIDE = 10_000  # the width of --wide: nothing is dropped or cut


def terminal_width() -> int:
    """``COLUMNS`` if set, else the terminal's width, else 80."""
    return shutil.get_terminal_size((80, 24)).columns


def human_bytes(n: float) -> str:
    """``1536`` → ``1.5KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}TiB"  # pragma: no cover - the loop returns


def _memory(w: WorkerInfo) -> str:
    if not w.device_memory:
        return "-"
    return " ".join(
        f"{d.device}:{human_bytes(d.used_bytes)}/{human_bytes(d.total_bytes)}"
        for d in w.device_memory
    )


def _tensors(w: WorkerInfo) -> str:
    return f"{w.tensors_held} ({human_bytes(w.bytes_held)})" if w.has_status else "-"


def lagging_models(snapshot: ClusterSnapshot) -> dict[str, dict[str, int]]:
    """Worker address -> {model: newest version} for the models it serves at a version
    older than the newest another live (not lost) worker reports: that worker is
    lagging behind a publish. Lost workers' statuses are their last before they
    stopped, so they neither set the newest version nor are marked."""
    live = [w for w in snapshot.workers if w.has_status and w.state is not WorkerState.LOST]
    newest: dict[str, int] = {}
    for w in live:
        for name, version in w.model_versions.items():
            newest[name] = max(version, newest.get(name, version))
    lagging = {}
    for w in live:
        behind = {name: newest[name] for name, v in w.model_versions.items() if v < newest[name]}
        if behind:
            lagging[w.address] = behind
    return lagging


def models_cell(w: WorkerInfo, lagging: Container[str] = (), limit: int = MODELS_CELL_CHARS) -> str:
    """``mlp@v3 enc@v1*`` (``*``: lagging), cut after ``limit`` characters to ``+N`` more.

    A model without a version (over the status's budget, or from a worker older
    than model versions) shows its name alone.
    """
    if not w.has_status or not w.models:
        return "-"
    shown: list[str] = []
    length = -1
    for name in w.models:
        version = w.model_versions.get(name)
        item = name if version is None else f"{name}@v{version}"
        item += LAGGING_MARK if name in lagging else ""
        if shown and length + 1 + len(item) > limit:
            break
        shown.append(item)
        length += 1 + len(item)
    more = len(w.models) - len(shown)
    return " ".join(shown + ([f"+{more}"] if more > 0 else []))


def _lagging_line(snapshot: ClusterSnapshot, lagging: dict[str, dict[str, int]]) -> str:
    """``lagging models: h:2 mlp@v2 (newest v3); ...`` for the workers behind a publish."""
    parts = []
    for w in snapshot.workers:
        behind = lagging.get(w.address, {})
        if behind:
            models = ", ".join(
                f"{name}@v{w.model_versions[name]} (newest v{newest})"
                for name, newest in sorted(behind.items())
            )
            parts.append(f"{w.address} {models}")
    return f"lagging models ({LAGGING_MARK} in MODELS): " + "; ".join(parts)


def _status_row(w: WorkerInfo, lagging: Container[str] = ()) -> tuple[str, ...]:
    return (
        str(w.rank) if w.rank >= 0 else "-",
        w.state.value,
        w.address,
        w.hostname,
        str(w.pid),
        ",".join(w.devices),
        str(w.generation),
        f"{w.last_heartbeat_age_s:.1f}s",
        _tensors(w),
        models_cell(w, lagging),
        str(w.ops_completed),
        str(w.ops_failed),
        str(w.queue_depth),
        _memory(w),
        w.last_op or "-",
    )


def _align(columns: Sequence[str], rows: Sequence[tuple[str, ...]]) -> list[str]:
    table = [tuple(columns), *rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(columns))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in table
    ]


def fit_table(
    columns: Sequence[str],
    rows: Sequence[tuple[str, ...]],
    drop_order: Sequence[str],
    width: int,
) -> list[str]:
    """The aligned table, without the columns of ``drop_order`` it must drop to fit ``width``."""
    keep = list(range(len(columns)))
    for name in (None, *drop_order):
        if name is not None:
            keep.remove(columns.index(name))
        lines = _align([columns[i] for i in keep], [tuple(r[i] for i in keep) for r in rows])
        if max(len(line) for line in lines) <= width:
            break
    hidden = len(columns) - len(keep)
    lines = [_cut(line, width) for line in lines]
    if hidden:
        lines.append(
            _cut(f"({hidden} columns hidden to fit {width} columns; --wide shows all)", width)
        )
    return lines


def _cut(line: str, width: int) -> str:
    return line if len(line) <= width else line[: max(width - 1, 0)] + "…"


def forming_line(snapshot: ClusterSnapshot) -> str:
    """What a cluster that is not formed yet waits for, and how to wait for it."""
    live = sum(1 for w in snapshot.workers if w.state != "lost")
    return (
        f"forming: {live} of {snapshot.min_workers} workers registered "
        f"(min {snapshot.min_workers}, max {snapshot.max_workers}); wait with "
        "`collectives status --watch`, or `collectives.connect(address, timeout=...)`"
    )


def format_table(address: str, snapshot: ClusterSnapshot, width: int | None = None) -> str:
    """The human-readable status: header lines, one aligned row per worker, history, errors."""
    width = terminal_width() if width is None else width
    header = [
        f"coordinator {address}  generation {snapshot.generation}  "
        f"world size {snapshot.world_size}  formed {'yes' if snapshot.formed else 'no'}  "
        f"ready {'yes' if snapshot.ready else 'no'}",
        f"status: {snapshot.status or '-'}",
    ]
    lagging = lagging_models(snapshot)
    rows = [_status_row(w, lagging.get(w.address, {})) for w in snapshot.workers]
    lines = [_cut(line, width) for line in header]
    lines += fit_table(STATUS_COLUMNS, rows, STATUS_DROP_ORDER, width)
    if not snapshot.formed:
        lines.append(_cut(forming_line(snapshot), width))
    if lagging:
        lines.append(_cut(_lagging_line(snapshot, lagging), width))
    for w in snapshot.workers:
        if w.stuck and w.state != "lost":
            lines.append(_cut(f"stuck on {w.address}: {w.stuck} (collectives diagnose)", width))
    if snapshot.history:
        last = snapshot.history[-1]
        sealed = time.strftime("%H:%M:%S", time.localtime(last.sealed_unix_time_s))
        lines.append(_cut(f"last generation change ({sealed}): {last.reason}", width))
    lines += [_cut(line, width) for line in drain_lines(snapshot)]
    lines += error_lines(snapshot, width)
    return "\n".join(lines)


DRAIN_LINES = 3  # the last drains shown under the table


def drain_lines(snapshot: ClusterSnapshot) -> list[str]:
    """The drain in progress (bytes copied of the total), then the last drains."""
    lines = []
    d = snapshot.drain
    if d is not None:
        onto = f"{d.successor_id} at {d.successor}" if d.successor else "nobody (shrinking)"
        mib, total = d.bytes_copied / 2**20, d.total_bytes / 2**20
        doing = f"preparing generation {d.generation_after}, " if d.preparing else ""
        lines.append(
            f"draining {d.worker_id} at {d.worker} (rank {d.rank}) onto {onto}: {doing}"
            f"{mib:.1f} of {total:.1f} MiB copied, since {_clock(d.started_unix_time_s)}"
        )
    if snapshot.drains:
        lines.append(
            f"drains: {snapshot.drains_completed} completed, "
            f"{snapshot.drain_bytes_total / 2**20:.1f} MiB handed over; the last:"
        )
    for r in snapshot.drains[-DRAIN_LINES:]:
        onto = f"onto {r.successor_id}" if r.successor else f"shrinking ({len(r.lost)} lost)"
        what = (
            f"failed: {r.error}"
            if r.error
            else f"{r.tensors_moved} tensors, {r.bytes_moved / 2**20:.1f} MiB, "
            f"{r.models_moved} models in {r.seconds:.2f} s"
        )
        lines.append(
            f"  {_clock(r.finished_unix_time_s)} {r.worker_id} (rank {r.rank}) {onto}: {what}"
        )
    return lines


def _clock(unix_s: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(unix_s))


def error_lines(snapshot: ClusterSnapshot, width: int) -> list[str]:
    """``errors:`` then one line per group of failed ops (the most recent first)."""
    groups = snapshot.error_groups()
    if not groups:
        return []
    lines = [f"errors ({len(groups)} distinct, most recent first):"]
    for merged in groups[:ERROR_LINES]:
        g = merged.group
        ranks = ",".join(str(r) for r in merged.ranks if r >= 0) or "-"
        details = [
            f"{_clock(g.first_unix_time_s)}-{_clock(g.last_unix_time_s)}",
            f"{g.rate_per_s:.2f}/s",
            f"ranks {ranks}",
        ]
        if g.last_op_id:
            details.append(f"last op {g.last_op_id}")
        if g.client:
            details.append(f"client {g.client}")
        lines.append(_cut(f"  {g.count}x {g.kind} {g.code}: {g.message}", width))
        lines.append(_cut("      " + ", ".join(details), width))
    return lines


def client_lines(snapshot: ClusterSnapshot, width: int) -> list[str]:
    """``clients:`` then one line per client seen in the last 60 s."""
    clients = snapshot.clients()
    if not clients:
        return []
    lines = [f"clients ({len(clients)} in the last 60 s):"]
    for c in clients[:CLIENT_LINES]:
        who = f"{c.name} at {c.host}" if c.name else c.host
        last = _clock(c.last_unix_time_s)
        text = f"  {who}  called {len(c.workers)} worker(s), last at {last}  "
        text += c.user_agent
        lines.append(_cut(text, width))
    return lines


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f}ms" if seconds > 0 else "-"


def _kind_cells(kind: str, who: str, c: OpCount) -> tuple[str, ...]:
    return (
        kind,
        who,
        f"{c.rate_per_s:.1f}",
        str(c.completed),
        str(c.failed),
        _ms(c.latency_p50_s),
        _ms(c.latency_p99_s),
        human_bytes(c.collective_bytes_received),
        human_bytes(c.collective_bytes_sent),
    )


def batch_rows(snapshot: ClusterSnapshot) -> list[tuple[str, ...]]:
    """One row per model loaded with batching and worker that reports it: the merged
    forwards its batcher ran, their rows, and rows per forward (how full batches are)."""
    rows = []
    members = sorted(
        (w for w in snapshot.workers if w.model_batches), key=lambda w: (w.rank < 0, w.rank)
    )
    for name in sorted({m for w in members for m in w.model_batches}):
        for w in members:
            if name not in w.model_batches:
                continue
            forwards, merged_rows = w.model_batches[name]
            rank = str(w.rank) if w.rank >= 0 else "-"
            per = f"{merged_rows / forwards:.1f}" if forwards else "-"
            rows.append((name, rank, str(forwards), str(merged_rows), per))
    return rows


def kind_rows(snapshot: ClusterSnapshot) -> list[tuple[str, ...]]:
    """The by-kind table's rows: per kind, the cluster's (``all``) then each live worker's."""
    rows = []
    live = [w for w in snapshot.workers if w.state is not WorkerState.LOST]
    for kind, total in snapshot.ops_by_kind().items():
        rows.append(_kind_cells(kind, "all", total))
        for w in live:
            if kind in w.ops:
                rows.append(_kind_cells("", str(w.rank) if w.rank >= 0 else w.address, w.ops[kind]))
    return rows


def worker_rate(w: WorkerInfo) -> float:
    """The worker's ops/s over every kind, as it reports them."""
    return sum(c.rate_per_s for c in w.ops.values())


def rates_between(
    previous: ClusterSnapshot | None, current: ClusterSnapshot, elapsed_s: float
) -> dict[str, float]:
    """Ops per second per worker address between two snapshots."""
    if previous is None or elapsed_s <= 0:
        return {}
    before = {w.address: w.ops_completed + w.ops_failed for w in previous.workers}
    return {
        w.address: max(0, w.ops_completed + w.ops_failed - before[w.address]) / elapsed_s
        for w in current.workers
        if w.address in before
    }


def format_top(
    address: str,
    snapshot: ClusterSnapshot,
    rates: dict[str, float] | None = None,
    width: int | None = None,
) -> str:
    """The ``top`` frame. A worker's OPS/S is what it reports (so the first frame
    has it); ``rates`` (from :func:`rates_between`) stands in for a worker that
    has not reported a status yet."""
    width = terminal_width() if width is None else width
    rates = rates or {}
    header = [
        f"collectives top  {address}  generation {snapshot.generation}  "
        f"world size {snapshot.world_size}  {time.strftime('%H:%M:%S')}",
        f"status: {snapshot.status or '-'}",
    ]
    rows = []
    for w in snapshot.workers:
        rate = worker_rate(w) if w.has_status else rates.get(w.address)
        rows.append(
            (
                str(w.rank) if w.rank >= 0 else "-",
                w.state.value,
                w.address,
                f"{rate:.1f}" if rate is not None else "-",
                str(w.ops_completed),
                str(w.ops_failed),
                str(w.queue_depth),
                _memory(w),
                _tensors(w),
                w.last_op or "-",
                f"{w.last_op_latency_s * 1000:.1f}ms" if w.last_op else "-",
            )
        )
    lines = [_cut(line, width) for line in header]
    lines += fit_table(TOP_COLUMNS, rows, TOP_DROP_ORDER, width)
    by_kind = kind_rows(snapshot)
    if by_kind:
        lines.append("")
        lines += fit_table(KIND_COLUMNS, by_kind, KIND_DROP_ORDER, width)
    batching = batch_rows(snapshot)
    if batching:
        lines.append("")
        lines += fit_table(BATCH_COLUMNS, batching, BATCH_DROP_ORDER, width)
    lines += error_lines(snapshot, width)
    lines += client_lines(snapshot, width)
    return "\n".join(lines)
