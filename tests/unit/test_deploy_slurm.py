"""deploy/slurm/collectives.sbatch without Slurm.

``bash -n`` checks its syntax; then it runs for real with stubs for srun,
scontrol and collectives-server on PATH, which record what it would start, and
each daemon's command line goes through the real ``collectives-server`` parser.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from daemon_cli import parse_coordinator, parse_worker

SBATCH = Path(__file__).resolve().parents[2] / "deploy/slurm/collectives.sbatch"
SAMPLE_TOKEN = "slurm-test-token"


def test_sbatch_is_valid_bash() -> None:
    result = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


_STUB = """#!{python}
# srun, scontrol and collectives-server for a dry run of the batch script.
import json, os, sys
name = os.path.basename(sys.argv[0])
if name == "scontrol":
    print("\\n".join(os.environ["STUB_NODES"].split()))
elif name == "srun":
    n = next(i for i, a in enumerate(sys.argv[1:], 1) if not a.startswith("--"))
    with open(os.environ["STUB_LOG"], "a") as log:
        log.write(json.dumps({{"srun": sys.argv[1:n]}}) + "\\n")
    os.execvp(sys.argv[n], sys.argv[n:])
else:
    paths = [a.split("=", 1)[1] for a in sys.argv[1:] if a.split("=")[0].endswith("-file")]
    modes = {{path: os.stat(path).st_mode & 0o777 for path in paths}}
    with open(os.environ["STUB_FIFO"], "w") as fifo:
        fifo.write(json.dumps({{"server": sys.argv[1:], "modes": modes}}) + "\\n")
"""
# The job's program: waits for both daemons' command lines (one fifo line
# each: no sleeping; a hang ends with the test's timeout), then records them
# and its environment.
_PROGRAM = """
import json, os, sys
lines = []
while len(lines) < 2:
    with open(os.environ["STUB_FIFO"]) as fifo:
        lines += fifo.read().splitlines()
keys = ("COLLECTIVES_COORDINATOR", "COLLECTIVES_TOKEN")
with open(os.environ["STUB_LOG"], "a") as log:
    log.writelines(line + "\\n" for line in lines)
    log.write(json.dumps({"env": {k: os.environ[k] for k in keys}}) + "\\n")
"""


def test_sbatch_starts_a_coordinator_and_a_worker_per_node(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "stub"
    stub.write_text(_STUB.format(python=sys.executable))
    stub.chmod(0o755)
    for name in ("srun", "scontrol", "collectives-server"):
        (bin_dir / name).symlink_to(stub)
    os.mkfifo(tmp_path / "fifo")
    nodes = ["gpu-a", "gpu-b", "gpu-c"]
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "HOME": str(tmp_path / "home"),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "gpu-[a-c]",
        "STUB_NODES": " ".join(nodes),
        "STUB_LOG": str(tmp_path / "log"),
        "STUB_FIFO": str(tmp_path / "fifo"),
    }
    job = subprocess.Popen(
        ["bash", str(SBATCH), sys.executable, "-c", _PROGRAM],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, stderr = job.communicate(timeout=60)
    finally:
        # The job's session: whatever it left behind (a stub blocked on the fifo).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 0, stderr
    records = [json.loads(line) for line in (tmp_path / "log").read_text().splitlines()]
    sruns = sorted(r["srun"] for r in records if "srun" in r)
    servers = {r["server"][0]: r["server"] for r in records if "server" in r}
    modes = {path: mode for r in records for path, mode in r.get("modes", {}).items()}
    (environment,) = [r["env"] for r in records if "env" in r]

    token_dir = tmp_path / "home/.collectives/job-4242"
    assert modes == {str(token_dir / "client-token"): 0o600, str(token_dir / "worker-token"): 0o600}
    assert not token_dir.exists(), "the job's tokens outlive it"
    token_dir.mkdir(parents=True)  # as it was while the daemons ran
    for name in ("client-token", "worker-token"):
        (token_dir / name).write_text(SAMPLE_TOKEN)

    coordinator = parse_coordinator(servers["coordinator"])
    assert (coordinator.host, coordinator.advertise_host) == ("0.0.0.0", nodes[0])
    assert coordinator.min_workers == coordinator.max_workers == len(nodes)
    assert coordinator.security.token == SAMPLE_TOKEN
    worker = parse_worker(servers["worker"])
    assert f"--coordinator={nodes[0]}:{coordinator.port}" in servers["worker"]
    assert worker.host == "0.0.0.0" and worker.worker_token == SAMPLE_TOKEN
    assert environment["COLLECTIVES_COORDINATOR"] == f"{nodes[0]}:{coordinator.port}"
    assert re.fullmatch("[0-9a-f]{64}", environment["COLLECTIVES_TOKEN"])
    assert sruns == sorted(
        [
            ["--nodes=1", "--ntasks=1", f"--nodelist={nodes[0]}", "--overlap", "--gres=none"],
            [f"--nodes={len(nodes)}", "--ntasks-per-node=1", "--overlap"],
        ]
    )
