"""The coordinator's web dashboard: a small page that shows the cluster live.

Served by the coordinator on its own HTTP port (``--dashboard-port``; bound to
127.0.0.1 unless ``--dashboard-host`` says otherwise) with the standard library's
:class:`http.server.ThreadingHTTPServer`, so it adds no dependency. The page is
plain HTML, CSS and JavaScript shipped in the package (``static/``): nothing is
built, and nothing is fetched from the network at run time.

Endpoints (all GET):

* ``/`` — the page; ``/app.js``, ``/model.js`` and ``/style.css`` its assets.
* ``/api/cluster`` — the current ``collectives.v1.Cluster`` as JSON, in the schema
  of ``collectives status --json`` (see :mod:`.dashboard_json`): integers as
  numbers, worker states as ``"ready"``, ``"lost"``...
* ``/api/events`` — Server-Sent Events: a ``cluster`` event with the same JSON at
  once, on every version change (the servicer's condition, which also wakes the
  ``WatchCluster`` streams), and every ``refresh_s`` seconds without a change, so
  heartbeat ages and uptimes stay current and a dead connection is noticed.
  The page falls back to polling ``/api/cluster`` when the stream fails.
* ``/healthz`` — ``ok`` while the coordinator serves.

Connections are bounded: each closes after ``idle_s`` seconds without
a request (or a stalled write), at most ``max_connections`` are open at once (more
are answered 503 and closed by the accepting thread), and the listen backlog is
1024; so no connection holds a thread forever and an idle crowd cannot starve
``/healthz``. See :mod:`.dashboard_limits`.

Read-only: nothing here changes the cluster, and nothing here asks for
credentials. The data (addresses, hostnames, states, rates) is operator
information; bind it to a public interface only on a network you trust. On a
cluster with a token (``--token-file``), what a token guards on gRPC is withheld
here: no tensor, model or client name an op carried, no call id, no error message
(``withhold_details``; :func:`.json_api.without_details`).
"""

from __future__ import annotations

import json
import logging
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from importlib import resources
from typing import Any, Protocol

from collectives.v1 import coordinator_pb2
from collectives.wire.op_phases import PHASES, SPANS
from collectives_server.coordinator.dashboard.json_api import cluster_to_json, without_details
from collectives_server.coordinator.dashboard.limits import BoundedHTTPServer, BoundedIPv6Server

__all__ = ["ClusterSource", "DashboardServer", "cluster_to_json"]

log = logging.getLogger(__name__)

# name in static/ -> content type; nothing else is served from there.
_ASSETS = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "model.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
# Made here, not shipped: the op phases the timeline draws, from their one definition.
_PHASES_JS = "phases.js"
_ROUTES = {
    "/": "index.html",
    "/index.html": "index.html",
    "/app.js": "app.js",
    "/model.js": "model.js",
    "/phases.js": _PHASES_JS,
    "/style.css": "style.css",
}
# The page loads only its own assets and talks only to this server.
_SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
    "frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


class ClusterSource(Protocol):
    """What the dashboard reads: the coordinator servicer (or a fake in tests)."""

    @property
    def closed(self) -> bool: ...

    def snapshot(self) -> coordinator_pb2.Cluster: ...

    def wait_for_change(
        self, after_version: int, timeout_s: float
    ) -> coordinator_pb2.Cluster | None: ...


def _load_assets() -> dict[str, bytes]:
    root = resources.files("collectives_server.coordinator.dashboard").joinpath("static")
    assets = {name: root.joinpath(name).read_bytes() for name in _ASSETS}
    assets[_PHASES_JS] = phases_js().encode()
    return assets


def phases_js() -> str:
    """``phases.js``: :mod:`collectives.wire.op_phases` for the page's model.js."""
    table = json.dumps({"phases": list(PHASES), "spans": [list(span) for span in SPANS]})
    return f'"use strict";\nwindow.COLLECTIVES_OP_PHASES = Object.freeze({table});\n'


class DashboardServer:
    """The dashboard's HTTP server; ``start()`` binds (port 0 picks a free one)."""

    def __init__(
        self,
        source: ClusterSource,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        refresh_s: float = 2.0,
        max_streams: int = 32,
        idle_s: float = 10.0,
        max_connections: int = 256,
        withhold_details: bool = False,
    ) -> None:
        """``withhold_details``: serve :func:`~.json_api.without_details` of every
        Cluster (a cluster whose gRPC endpoints need a token: these take none)."""
        if refresh_s <= 0:
            raise ValueError(f"refresh_s must be > 0, got {refresh_s}")
        if idle_s <= 0 or max_connections < 1:
            raise ValueError(
                f"idle_s must be > 0 and max_connections >= 1, got {idle_s}, {max_connections}"
            )
        self.idle_s = idle_s
        self.max_connections = max_connections
        self._source = source
        self._host = host
        self._port = port
        self.refresh_s = refresh_s
        self.max_streams = max_streams
        self.withhold_details = withhold_details
        self._streams = 0
        self._lock = threading.Lock()
        self._assets = _load_assets()
        self._stopping = threading.Event()
        self._httpd: BoundedHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> DashboardServer:
        if self._httpd is not None:
            raise RuntimeError("dashboard already started")
        handler = type("DashboardHandler", (_Handler,), {"dashboard": self, "timeout": self.idle_s})
        server_class = BoundedIPv6Server if ":" in self._host else BoundedHTTPServer
        httpd = server_class(
            (self._host.strip("[]"), self._port), handler, max_connections=self.max_connections
        )
        httpd.daemon_threads = True  # open event streams must not hold up shutdown
        self._httpd = httpd
        self._thread = threading.Thread(
            target=httpd.serve_forever, kwargs={"poll_interval": 0.5}, name="dashboard"
        )
        self._thread.daemon = True
        self._thread.start()
        log.info("dashboard on http://%s/", self.address)
        return self

    def stop(self) -> None:
        """Stops accepting; open event streams end at their next wake (<= refresh_s)."""
        self._stopping.set()
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None

    @property
    def open_connections(self) -> int:
        """Connections being served now."""
        return self._httpd.open_connections if self._httpd is not None else 0

    @property
    def refused_connections(self) -> int:
        """Connections answered 503 and closed for the connection cap (a counter)."""
        return self._httpd.refused_connections if self._httpd is not None else 0

    @property
    def port(self) -> int:
        if self._httpd is None:
            raise RuntimeError("dashboard not started")
        return int(self._httpd.server_address[1])

    @property
    def address(self) -> str:
        host = self._host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"{host}:{self.port}"

    # ---- used by the handler -------------------------------------------------

    def open_stream(self) -> bool:
        """Counts an event stream in; False beyond ``max_streams`` (each holds a thread)."""
        with self._lock:
            if self._streams >= self.max_streams:
                return False
            self._streams += 1
            return True

    def close_stream(self) -> None:
        with self._lock:
            self._streams -= 1

    def asset(self, name: str) -> tuple[bytes, str]:
        return self._assets[name], _ASSETS.get(name, _ASSETS["model.js"])

    def snapshot(self) -> coordinator_pb2.Cluster:
        return self._shown(self._source.snapshot())

    def _shown(self, cluster: coordinator_pb2.Cluster) -> coordinator_pb2.Cluster:
        return without_details(cluster) if self.withhold_details else cluster

    def next_event(self, after_version: int) -> coordinator_pb2.Cluster | None:
        """The next Cluster to push: on a change, or the current one after refresh_s.

        None when the stream must end (the dashboard or the coordinator stops).
        """
        if self._stopping.is_set() or self._source.closed:
            return None
        changed = self._source.wait_for_change(after_version, self.refresh_s)
        if self._stopping.is_set() or self._source.closed:
            return None
        return self._shown(changed) if changed is not None else self.snapshot()


class _Handler(BaseHTTPRequestHandler):
    dashboard: DashboardServer  # set on the subclass made in DashboardServer.start
    server_version = "collectives-dashboard"
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        try:
            if path in _ROUTES:
                body, content_type = self.dashboard.asset(_ROUTES[path])
                self._send(HTTPStatus.OK, body, content_type)
            elif path == "/api/cluster":
                body = cluster_to_json(self.dashboard.snapshot()).encode()
                self._send(HTTPStatus.OK, body, "application/json")
            elif path == "/api/events":
                if self.dashboard.open_stream():
                    try:
                        self._events()
                    finally:
                        self.dashboard.close_stream()
                else:
                    body = b"too many event streams; poll /api/cluster\n"
                    self._send(HTTPStatus.SERVICE_UNAVAILABLE, body, "text/plain; charset=utf-8")
            elif path == "/healthz":
                self._send(HTTPStatus.OK, b"ok\n", "text/plain; charset=utf-8")
            else:
                self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain; charset=utf-8")
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            self.close_connection = True  # the browser went away; nothing to answer

    def _send(self, status: HTTPStatus, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in _SECURITY_HEADERS.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def _events(self) -> None:
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        for name, value in _SECURITY_HEADERS.items():
            self.send_header(name, value)
        self.send_header("X-Accel-Buffering", "no")  # tell reverse proxies not to buffer
        self.end_headers()
        self.close_connection = True  # the stream ends only with the connection
        retry_ms = int(self.dashboard.refresh_s * 1000)
        cluster: coordinator_pb2.Cluster | None = self.dashboard.snapshot()
        self.wfile.write(f"retry: {retry_ms}\n\n".encode())
        while cluster is not None:
            data = cluster_to_json(cluster)
            self.wfile.write(f"event: cluster\nid: {cluster.version}\ndata: {data}\n\n".encode())
            self.wfile.flush()
            cluster = self.dashboard.next_event(cluster.version)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)
