"""A real, single-member etcd on free loopback ports, for the HA coordinator tests.

The binary is Debian's ``etcd-server`` package (``.ci/run`` installs it). Outside
CI a test that needs it skips without it; in CI (``CI=true``) it fails instead.
The server can be stopped and started again on the same ports and data
directory, as an etcd outage would look to its clients.
"""

from __future__ import annotations

import json
import signal
import subprocess
import urllib.request
from pathlib import Path

from helpers import required_binary, wait_until
from launcher import free_port

__all__ = ["EtcdServer", "etcd_binary"]

MISSING = "etcd is not installed (Debian: apt-get install etcd-server)"


def etcd_binary() -> str:
    """The ``etcd`` binary; skips the test without one (fails with CI=true)."""
    return required_binary("etcd", MISSING)


class EtcdServer:
    """``etcd`` listening on 127.0.0.1 only; ``url`` is the ``--store`` value."""

    def __init__(self, data_dir: Path) -> None:
        self.binary = etcd_binary()
        self.data_dir = data_dir
        self.client_port = free_port()
        self.peer_port = free_port()
        self.log_path = data_dir.parent / f"{data_dir.name}.log"
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def url(self) -> str:
        return f"etcd://{self.endpoint}"

    def start(self, timeout_s: float = 30.0) -> None:
        client = f"http://{self.endpoint}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    self.binary,
                    "--name=test",
                    f"--data-dir={self.data_dir}",
                    f"--listen-client-urls={client}",
                    f"--advertise-client-urls={client}",
                    f"--listen-peer-urls={peer}",
                    f"--initial-advertise-peer-urls={peer}",
                    f"--initial-cluster=test={peer}",
                    "--logger=zap",
                    "--log-level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        wait_until(self.healthy, timeout_s, f"etcd on {self.endpoint} to be healthy")

    def healthy(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            raise AssertionError(f"etcd exited; its log: {self.log_path.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1) as reply:
                return json.loads(reply.read()).get("health") == "true"
        except OSError:
            return False

    def stop(self) -> None:
        """SIGTERM, as an operator stopping it would (the data stays)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)
        self.proc = None
