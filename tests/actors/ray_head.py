"""A private Ray cluster for a test module: `ray start --head --block` in its own session.

Tearing it down stops exactly the processes it started (never `ray stop`, which would stop every cluster
on the machine), and `run` subprocesses attach to it through RAY_ADDRESS.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CURRENT_CLUSTER_FILE = Path("/tmp/ray/ray_current_cluster")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def auth_env() -> dict:
    """RAY_AUTH_MODE for a plain Ray client of the test cluster, as strata_ray.actors.launch decides it for
    `run`: token when the user chose it or a token exists (Ray 2.5x's `ray start` turned token auth on and
    wrote ~/.ray/auth_token; 2.60's does not, and a client forced into token mode then fails)."""
    if "RAY_AUTH_MODE" in os.environ:
        return {"RAY_AUTH_MODE": os.environ["RAY_AUTH_MODE"]}
    token = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    return {"RAY_AUTH_MODE": "token"} if os.environ.get("RAY_AUTH_TOKEN") or os.path.isfile(token) else {}


def client_env(address: str | None) -> dict:
    """Environment of a `run` subprocess: this checkout, no GPU, attached to `address` (None: no cluster)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    env.pop("RAY_ADDRESS", None)
    return env if address is None else {**env, "RAY_ADDRESS": address}


@contextlib.contextmanager
def ray_head(tmp: Path, dashboard: bool = False, while_starting=None, metrics_port: int | None = None
             ) -> Iterator[str]:
    """Start the head, run `while_starting()` meanwhile, wait until it is up; yields its address.
    metrics_port: the node's Prometheus endpoint (http://127.0.0.1:PORT/metrics, where ray.util.metrics
    reach a scraper), its workers reporting every 500 ms instead of Ray's default 10 s."""
    port = free_port()
    dash = (["--dashboard-host", "127.0.0.1", "--dashboard-port", str(free_port())] if dashboard
            else ["--include-dashboard", "false"])
    if metrics_port is not None:
        dash += ["--metrics-export-port", str(metrics_port),
                 "--system-config", '{"metrics_report_interval_ms": 500}']
    log_path = tmp / "ray_start.log"
    log = open(log_path, "w")
    head = subprocess.Popen(
        ["ray", "start", "--head", "--block", "--port", str(port), "--num-cpus", "2", "--disable-usage-stats",
         *dash],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        if while_starting is not None:
            while_starting()
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in log_path.read_text():
            assert head.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.3)
        yield f"127.0.0.1:{port}"
    finally:
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops its processes on SIGTERM
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(head.pid, signal.SIGKILL)  # anything of its session still alive
        except ProcessLookupError:
            pass
        log.close()
        if CURRENT_CLUSTER_FILE.exists() and CURRENT_CLUSTER_FILE.read_text().strip().endswith(f":{port}"):
            CURRENT_CLUSTER_FILE.unlink()  # do not leave other Ray users pointing at a stopped cluster
