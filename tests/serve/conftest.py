"""One real server for the serve tests: `python -m strata_ray.run serve` on 127.0.0.1, a free port, its own
local Ray instance, the embedded model (or the tiny synth model while the embedded one is absent)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

REPO = Path(__file__).resolve().parents[2]
API_KEY = "test-key-123"
START_TIMEOUT_S = 180


@dataclass
class Server:
    url: str
    api_key: str
    model_path: Path
    proc: subprocess.Popen
    log: Path

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def post(self, path: str, body, **kw) -> requests.Response:
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        return requests.post(self.url + path, data=data, headers={**self.auth, **kw.pop("headers", {})},
                             timeout=kw.pop("timeout", 120), **kw)

    def get(self, path: str, **kw) -> requests.Response:
        return requests.get(self.url + path, headers={**self.auth, **kw.pop("headers", {})}, timeout=30, **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def model_path(tmp_path_factory) -> Path:
    from strata_ray.model.loader import default_model_path

    embedded = default_model_path()
    if embedded.is_file():
        return embedded
    from strata_ray.model.synth import write_synth

    path = tmp_path_factory.mktemp("model") / "tiny-next.gguf"
    write_synth(path, arch="qwen3next", preset="tiny", progress=False)
    return path


@pytest.fixture(scope="session")
def engine(model_path):
    """The in-process engine on the same model: the server's greedy output must equal it."""
    from strata_ray.config import EngineConfig
    from strata_ray.engine.engine import Engine

    return Engine(EngineConfig(model=str(model_path), device="cpu"))


def start_server(model_path, work: Path, **keys) -> Server:
    """The server on a free port (a fresh one while another process takes the port between free_port and
    the server's bind: a Ray instance of the other test worker, say, which opens ports of its own); keys:
    more serve.json keys."""
    for attempt in range(3):
        port = free_port()
        config = work / f"serve-{attempt}.json"
        config.write_text(json.dumps({"model": str(model_path), "host": "127.0.0.1", "port": port,
                                      "api_key": API_KEY, "args": ["--device", "cpu"], **keys}))
        log = work / f"server-{attempt}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "strata_ray.run", "serve", "--config", str(config),
                                     "--address", "local"], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONPATH": str(REPO)})
        srv = Server(f"http://127.0.0.1:{port}", API_KEY, model_path, proc, log)
        taken = _wait_ready(srv, retry_taken=attempt < 2)
        if not taken:
            return srv
    raise AssertionError("unreachable: the last attempt fails in _wait_ready")


@pytest.fixture(scope="session")
def server(model_path, tmp_path_factory):
    srv = start_server(model_path, tmp_path_factory.mktemp("serve"))
    proc, log = srv.proc, srv.log
    try:
        yield srv
    finally:
        # stopped as systemd, `docker stop` or Kubernetes stop it: Ray's SIGTERM handlers (ray.init's, the
        # core worker's) killed it with a C++ stack and exit 15 before serve_main could stop and clean up
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            pytest.fail(f"the server did not stop on SIGTERM within 60 s: {log.read_text()[-2000:]}")
    tail = log.read_text()[-2000:]
    assert proc.returncode == 0 and "strata_ray: stopped" in tail, f"exit {proc.returncode}: {tail}"


def _wait_ready(srv: Server, retry_taken: bool = False) -> bool:
    """Wait until the server is loaded; True (no server) where it exited because its port was taken and the
    caller may try another."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if srv.proc.poll() is not None:
            tail = srv.log.read_text()[-2000:]
            if retry_taken and "Address already in use" in tail:
                return True
            pytest.fail(f"the server exited with {srv.proc.returncode}: {tail}")
        try:
            if requests.get(srv.url + "/health", timeout=2).json().get("loaded"):
                return False
        except (requests.RequestException, ValueError):
            pass
        time.sleep(0.5)
    pytest.fail(f"the server did not become ready in {START_TIMEOUT_S} s: {srv.log.read_text()[-2000:]}")
