"""A real Prometheus server for the tests, configured from docker/prometheus/prometheus.yml.

The binary is Debian's ``prometheus`` package (``.ci/run`` installs it). Outside CI
a test that needs it skips without it; in CI (``CI=true``) it fails instead, as the
browser test does without Chromium, so the check can never silently stop running.

The configuration is the project's own file with only what must change on a test
machine changed (:func:`local_config`): every static target is replaced by the
live loopback address of a daemon of the same ``role`` label, and the intervals are
shortened. Job names, labels and anything else in the file reach Prometheus as
written, so the queries are evaluated against the series the compose stack stores.

Prometheus listens on ``127.0.0.1:0`` and the test reads the port it got from its
log ("Listening on" address=...), as it does for the daemons.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from helpers import required_binary, wait_until

__all__ = ["PROJECT_CONFIG", "Prometheus", "local_config", "prometheus_binary"]

PROJECT_CONFIG = Path(__file__).resolve().parents[1] / "docker/prometheus/prometheus.yml"
MISSING = "needs the prometheus binary on PATH: apt-get install prometheus"
_LISTENING = re.compile(r'msg="Listening on" address=(\S+)')
_HTTP_TIMEOUT_S = 10.0


def prometheus_binary() -> str:
    """The path of the ``prometheus`` binary; skips the test without one (fails with CI=true)."""
    return required_binary("prometheus", MISSING)


def local_config(
    project: Mapping[str, Any], targets: Mapping[str, Sequence[str]], interval: str
) -> dict[str, Any]:
    """``project`` (a parsed prometheus.yml) pointed at live daemons and sped up.

    ``targets``: live ``host:port`` addresses by role (the ``role`` label of each
    static config); each static config's targets are replaced, in order, by as
    many addresses of its role. ``interval`` (a Prometheus duration, "1s")
    replaces every scrape and evaluation interval, and every scrape timeout (which
    may not exceed the interval). Everything else is kept.

    Raises ValueError when the file and the live daemons do not match one to one,
    or a job discovers its targets otherwise than by ``static_configs``.
    """
    config = copy.deepcopy(dict(project))
    left = {role: list(addresses) for role, addresses in targets.items()}
    glob = config.setdefault("global", {})
    glob["scrape_interval"] = glob["evaluation_interval"] = interval
    for section in [glob, *config.get("scrape_configs", [])]:
        for key in ("scrape_interval", "scrape_timeout"):
            if key in section:
                section[key] = interval
    for job in config.get("scrape_configs", []):
        others = [k for k in job if k.endswith("_sd_configs")]
        if others:
            raise ValueError(f"job {job['job_name']}: only static_configs are supported: {others}")
        for static in job.get("static_configs", []):
            role = static.get("labels", {}).get("role")
            wanted = len(static["targets"])
            live = left.get(role, [])
            if len(live) < wanted:
                raise ValueError(
                    f"job {job['job_name']}: {wanted} targets of role {role!r}, "
                    f"only {len(live)} live daemons left of that role"
                )
            static["targets"], left[role] = live[:wanted], live[wanted:]
    unused = {role: addresses for role, addresses in left.items() if addresses}
    if unused:
        raise ValueError(f"live daemons that no job of the project's file scrapes: {unused}")
    return config


class Prometheus:
    """``prometheus`` as a child process, with its HTTP API.

    A context manager; :meth:`stop` terminates it (SIGTERM, then SIGKILL).
    Its log is ``directory/prometheus.log``.
    """

    def __init__(
        self, binary: str, config: Mapping[str, Any], directory: Path, start_timeout_s: float = 30
    ) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.config_path = directory / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(dict(config), sort_keys=False))
        self.log_path = directory / "prometheus.log"
        argv = [
            binary,
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={directory / 'data'}",
            "--web.listen-address=127.0.0.1:0",
        ]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        try:
            address = wait_until(
                self._address, start_timeout_s, f"Prometheus's address in {self.log_path}"
            )
            if address == "exited":
                raise AssertionError(f"prometheus exited:\n{self.log_path.read_text()}")
            self.url = f"http://{address}"
            wait_until(self._ready, start_timeout_s, f"{self.url}/-/ready")
        except BaseException:
            self.stop()
            raise

    def _address(self) -> str | None:
        if self.proc.poll() is not None:
            return "exited"
        match = _LISTENING.search(self.log_path.read_text(errors="replace"))
        return match.group(1) if match else None

    def _ready(self) -> bool:
        with urllib.request.urlopen(f"{self.url}/-/ready", timeout=_HTTP_TIMEOUT_S) as response:
            return response.status == 200

    def api(self, path: str, **params: str | Sequence[str]) -> Any:
        """GET ``/api/v1/<path>``; its ``data``. Fails on an error status, with its message."""
        query = urllib.parse.urlencode(params, doseq=True)
        url = f"{self.url}/api/v1/{path}?{query}"
        try:
            with urllib.request.urlopen(url, timeout=_HTTP_TIMEOUT_S) as response:
                body = json.load(response)
        except urllib.error.HTTPError as exc:  # 400/422/503 carry a JSON error
            body = json.loads(exc.read() or b"{}")
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's ``result`` (a vector's series)."""
        return self.api("query", query=expr)["result"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def __enter__(self) -> Prometheus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
