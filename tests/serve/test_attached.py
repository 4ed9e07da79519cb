"""`serve` attached to a cluster started with `ray start --head`: one strata server a cluster, and Ray
Serve's proxy port kept by the cluster, each told in one line before anything of the running server moves."""

import os
import select
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.actors.ray_head import REPO, auth_env, client_env, free_port, ray_head

# a switch's value inside the server's replica (the process the engine runs in)
REPLICA_ENV = """
import os, sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR")
names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
         if a["name"].startswith("SERVE_REPLICA::strata")]
replica = ray.get_actor(names[0], namespace="serve")
print(ray.get(replica.__ray_call__.remote(lambda self: os.environ.get("STRATA_FUSED_DECODE"))))
"""


@pytest.fixture(scope="module")
def address(tmp_path_factory):
    with ray_head(tmp_path_factory.mktemp("serve_attached")) as address:
        yield address


def serve_cli(address, port, timeout=180):
    return subprocess.run([sys.executable, "-m", "strata_ray.run", "serve", "--address", address, "--port",
                           str(port), "--device", "cpu"], capture_output=True, text=True,
                          env=client_env(None), cwd=REPO, timeout=timeout, stdin=subprocess.DEVNULL)


def test_a_second_server_on_the_cluster_is_refused_and_the_first_keeps_serving(address):
    """A second `serve` replaced the first one's application, printed a port nothing listened on, and on its
    stop deleted the first one's application. (--address with no RAY_AUTH_MODE: attaching as `run` does,
    a token cluster included.) A switch set in the server's shell only reaches its replica (it ran in the
    raylet's environment, without it)."""
    first_port, other_port = free_port(), free_port()
    first = subprocess.Popen(
        [sys.executable, "-m", "strata_ray.run", "serve", "--address", address, "--port", str(first_port),
         "--device", "cpu"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, bufsize=0,
        env={**client_env(None), "STRATA_FUSED_DECODE": "0"}, cwd=REPO, stdin=subprocess.DEVNULL)
    try:
        deadline, seen = time.monotonic() + 240, b""
        while b"serving on" not in seen:  # raw reads: a buffered reader hides lines from select
            assert first.poll() is None and time.monotonic() < deadline, seen.decode()
            if select.select([first.stderr], [], [], 1.0)[0]:
                seen += os.read(first.stderr.fileno(), 65536)
        for port in (other_port, first_port):
            r = serve_cli(address, port)
            assert r.returncode == 2 and r.stderr.splitlines()[-1] == (
                "strata_ray: a strata server already runs on this Ray cluster (Ray Serve application "
                "'strata'); stop it first (one server a cluster), or serve on --address local"), r.stderr
        with urllib.request.urlopen(f"http://127.0.0.1:{first_port}/health", timeout=30) as answer:
            assert answer.status == 200  # the first server still serves
        seen = subprocess.run([sys.executable, "-c", REPLICA_ENV, address], capture_output=True, text=True,
                              env={**client_env(address), **auth_env()}, timeout=120)
        assert seen.stdout.strip().splitlines()[-1:] == ["0"], seen.stderr
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)
    r = serve_cli(address, other_port)  # Ray Serve's proxy stays on the cluster, on the first port
    assert r.returncode == 2 and r.stderr.splitlines()[-1] == (
        f"strata_ray: Ray Serve already runs on this cluster with its HTTP proxy on port {first_port}, which "
        f"it keeps: serve with --port {first_port} (or restart the cluster)"), r.stderr
