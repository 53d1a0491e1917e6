"""The Prometheus endpoint shared by the coordinator and the workers.

Each daemon has its own :class:`prometheus_client.CollectorRegistry` (never the
process-global one), so several daemons in one process (tests) do not collide.
Metrics that mirror state (generation, queue depth, tensors held, memory) are
computed when Prometheus scrapes, by a custom collector reading the daemon,
rather than updated at every place the state changes; counters are read from
the daemon's own counts the same way. Metric names are a contract with the
Grafana dashboard in ``docker/``: see ``docs/design.md`` ("Observability").
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["MetricsServer", "FunctionCollector", "build_info", "new_registry"]

log = logging.getLogger(__name__)


def new_registry() -> CollectorRegistry:
    return CollectorRegistry(auto_describe=False)


class FunctionCollector(Collector):
    """A collector whose metrics come from a function called at every scrape."""

    def __init__(self, collect: Callable[[], Iterable[Metric]]) -> None:
        self._collect = collect

    def collect(self) -> Iterable[Metric]:
        try:
            yield from self._collect()
        except Exception:  # a scrape must not take the daemon down, nor hide why it failed
            log.exception("collecting metrics failed")
            raise


def build_info(version: str, torch_version: str, backend: str) -> GaugeMetricFamily:
    g = GaugeMetricFamily(
        "collectives_build_info",
        "Versions of this daemon (always 1)",
        labels=["version", "torch", "backend"],
    )
    g.add_metric([version, torch_version, backend], 1.0)
    return g


class MetricsServer:
    """``/metrics`` over HTTP on ``host:port`` (port 0: any free port) in a daemon thread."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int, what: str) -> None:
        self._httpd, self._thread = start_http_server(port, addr=host, registry=registry)
        self.host = host
        self.port = int(self._httpd.server_port)
        log.info("%s metrics at http://%s/metrics", what, self.address)

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=2.0)
