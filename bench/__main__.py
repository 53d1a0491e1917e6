"""``python -m bench [--quick] [--only NAME,...] [--json PATH] [--markdown PATH]``.

Imports every ``bench/row_*.py`` module, runs each (``run(ctx) -> list[Row]``),
prints the machine and one markdown table, and writes it as JSON and markdown.
A row module that fails to import or raises is reported and skipped, so the
others still run; the exit status is then 1. A missed target is not an error
(the table says so in its ``met`` column).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback
from pathlib import Path

from .core import BenchContext, Row, Skip, close_shared_clusters, machine

# The row order; row modules not listed here come after, by name.
ORDER = [
    "putget",
    "replicate",
    "shm",
    "collectives",
    "coalesced",
    "latency",
    "flight_recorder",
    "concurrency",
    "inference",
    "inference_floor",
    "fleet",
    "tls",
    "training",
    "coordinator",
    "detection",
    "handoff",
    "memory",
    "gpu",
    "publish",
    "scaling",
]

COLUMNS = [
    "group",
    "measurement",
    "service p50 (p99, worst)",
    "anchor",
    "anchor p50 (p99, worst)",
    "ratio",
    "target",
    "met",
]
# The terminal table: at most this wide; the full table is in artifacts/bench.md.
TERMINAL_WIDTH = 120


# Row modules that raised Skip in this run, with the reason (shown under the table).
skipped: dict[str, str] = {}


def discover() -> list[str]:
    """Names of the row modules (``bench/row_NAME.py`` -> ``NAME``), in table order."""
    here = Path(__file__).resolve().parent
    names = [p.stem.removeprefix("row_") for p in here.glob("row_*.py")]
    rank = {name: i for i, name in enumerate(ORDER)}
    return sorted(names, key=lambda n: (rank.get(n, len(ORDER)), n))


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _met(row: Row) -> str:
    met = row.met()
    return "" if met is None else ("yes" if met else "**no**")


def _ratio(row: Row) -> str:
    r = row.ratio
    return "n/a" if r != r else f"{r:.3g}"  # NaN when the anchor is 0


def markdown_table(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = [
            row.group,
            row.what,
            row.service.text(),
            row.anchor_name,
            row.anchor.text(),
            _ratio(row),
            row.target,
            _met(row),
        ]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines)


def terminal_table(rows: list[Row], width: int = TERMINAL_WIDTH) -> str:
    """The table for a terminal: one line per row, at most ``width`` columns."""
    header = ("measurement", "service p50 (p99, worst)", "anchor p50", "ratio", "target", "met")
    cells = [
        (
            f"{row.group}: {row.what}",
            row.service.text(),
            row.anchor.text().split(" (")[0],
            _ratio(row),
            row.target,
            _met(row).strip("*"),
        )
        for row in rows
    ]
    fixed = [max(len(c[i]) for c in [header, *cells]) for i in range(1, len(header))]
    first = max(12, min(max(len(c[0]) for c in [header, *cells]), width - sum(fixed) - 2 * 5))
    widths = [first, *fixed]

    def line(row: tuple[str, ...]) -> str:
        parts = []
        for text, w in zip(row, widths, strict=True):
            text = text if len(text) <= w else text[: w - 1] + "…"
            parts.append(text.ljust(w))
        return "  ".join(parts).rstrip()[:width]

    return "\n".join([line(header), *(line(c) for c in cells)])


def notes(rows: list[Row]) -> list[str]:
    return [f"- {row.group} / {row.what}: {row.note}" for row in rows if row.note]


def render_markdown(
    mach: dict, quick: bool, rows: list[Row], failures: dict[str, str], timings: dict
) -> str:
    mode = "quick" if quick else "full"
    desc = ", ".join(f"{k} {v}" for k, v in mach.items())
    parts = [f"Machine: {desc}; mode: {mode}", "", markdown_table(rows)]
    if notes(rows):
        parts += ["", "Notes:", *notes(rows)]
    if skipped:
        parts += ["", "Skipped rows:", *(f"- {n}: {why}" for n, why in skipped.items())]
    if failures:
        parts += ["", "Failed row modules:", *(f"- {n}: {e}" for n, e in failures.items())]
    timing = ", ".join(f"{n} {s:.1f} s" for n, s in timings.items())
    parts += ["", f"Row times: {timing}"]
    return "\n".join(parts) + "\n"


def run_rows(
    names: list[str], ctx: BenchContext
) -> tuple[list[Row], dict[str, str], dict[str, float]]:
    rows: list[Row] = []
    failures: dict[str, str] = {}
    timings: dict[str, float] = {}
    skipped.clear()
    for name in names:
        started = time.perf_counter()
        print(f"bench: running {name} ...", file=sys.stderr, flush=True)
        try:
            module = importlib.import_module(f"bench.row_{name}")
            got = module.run(ctx)
            for row in got:
                if not isinstance(row, Row):
                    raise TypeError(f"run() returned {type(row).__name__}, not Row")
            rows.extend(got)
        except Skip as skip:
            skipped[name] = str(skip)
            print(f"bench: row {name!r} skipped: {skip}", file=sys.stderr)
        except BaseException as exc:  # one broken row (even a sys.exit) must not hide the others
            if isinstance(exc, KeyboardInterrupt):
                raise
            traceback.print_exc(file=sys.stderr)
            failures[name] = f"{type(exc).__name__}: {exc}"
            print(f"bench: row {name!r} FAILED, skipped: {failures[name]}", file=sys.stderr)
            close_shared_clusters()  # the next row starts from a fresh cluster
        timings[name] = time.perf_counter() - started
        print(f"bench: {name} took {timings[name]:.1f} s", file=sys.stderr, flush=True)
    return rows, failures, timings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench", description="The service beside anchors measured in the same run."
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (CI): < 2 min in all")
    parser.add_argument("--only", default="", help="comma-separated row names (e.g. putget)")
    parser.add_argument("--json", default="artifacts/bench.json", help="write rows as JSON here")
    parser.add_argument("--markdown", default="artifacts/bench.md", help="write the table here")
    parser.add_argument("--list", action="store_true", help="print the row names and exit")
    args = parser.parse_args(argv)

    names = discover()
    if args.list:
        print("\n".join(names))
        return 0
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in names]
        if unknown:
            parser.error(f"unknown row(s) {', '.join(unknown)}; rows: {', '.join(names)}")
        names = [n for n in names if n in wanted]

    ctx = BenchContext(quick=args.quick)
    mach = machine()
    started = time.perf_counter()
    rows, failures, timings = run_rows(names, ctx)
    close_shared_clusters()
    total = time.perf_counter() - started
    mach_after = machine()

    text = render_markdown(mach, args.quick, rows, failures, timings)
    print()
    print(terminal_table(rows))
    for name, why in {**skipped, **failures}.items():
        print(f"{name}: {why}"[:TERMINAL_WIDTH])
    print(f"Total: {total:.1f} s; the full table with notes: {args.markdown or '(not written)'}")

    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "machine": mach,
            "loadavg_1m_after": mach_after.get("loadavg_1m"),
            "mode": "quick" if args.quick else "full",
            "rows": [row.as_dict() for row in rows],
            "failures": failures,
            "skipped": dict(skipped),
            "timings_s": timings,
            "total_s": total,
        }
        path.write_text(json.dumps(doc, indent=2, default=str, allow_nan=True) + "\n")
    if args.markdown:
        path = Path(args.markdown)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
