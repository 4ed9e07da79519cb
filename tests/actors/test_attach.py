"""`run` attached to a cluster started with `ray start --head`: named actors in namespace strata, kept actors
reused, Ctrl-C never stops the cluster, and an actor that dies ends the command with one line.

One cluster for the module. It is started with `ray start --block` in its own session, so tearing it down
stops exactly the processes it started (never `ray stop`, which would stop every cluster on the machine).
"""

import json
import select
import signal
import subprocess
import sys

import pytest

from strata_ray.actors.launch import COORDINATOR_NAME, NAMESPACE, PLACEMENT_GROUP_TAKEN, PRIMARY_NAME
from strata_ray.model.synth import write_synth
from tests.actors.ray_head import REPO, auth_env, client_env, ray_head


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("attach")
    model = tmp / "tiny.gguf"

    def write_model():
        write_synth(model, arch="qwen3next", preset="tiny", progress=False)

    # the dashboard serves the state API that list_actors reads
    with ray_head(tmp, dashboard=True, while_starting=write_model) as address:
        yield address, str(model)


def run_cli(address, *args, timeout=300):
    return subprocess.run([sys.executable, "-m", "strata_ray.run", *args], capture_output=True, text=True,
                          env=client_env(address), cwd=REPO, timeout=timeout, stdin=subprocess.DEVNULL)


def strata_actors(address: str) -> dict[str, str]:
    """name -> state of the actors in namespace strata, through the state API (as the dashboard sees them)."""
    code = (
        "import json\n"
        "from ray.util.state import list_actors\n"
        f"actors = list_actors(address={address!r}, filters=[('ray_namespace', '=', {NAMESPACE!r})])\n"
        "print(json.dumps({a.name: a.state for a in actors if a.state != 'DEAD'}))\n"
    )
    env = {**client_env(address), **auth_env()}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_attaches_and_places_named_actors(cluster):
    address, model = cluster
    args = ["--model", model, "--prompt", "def main():", "--max-tokens", "12", "--json"]
    r = run_cli(address, *args, "--keep-actors")
    assert r.returncode == 0, r.stderr
    assert r.stderr.startswith("strata_ray: attached to the running Ray cluster at ")
    first = json.loads(r.stdout)
    assert strata_actors(address) == {PRIMARY_NAME: "ALIVE", COORDINATOR_NAME: "ALIVE"}

    # the kept actors serve the next run with the same flags, with the same tokens
    r = run_cli(address, *args)
    assert r.returncode == 0, r.stderr
    assert f"strata_ray: reusing {PRIMARY_NAME} and {COORDINATOR_NAME} kept by an earlier run" in r.stderr
    assert json.loads(r.stdout)["token_ids"] == first["token_ids"]

    # other flags: refused in one line, unless asked to replace them
    r = run_cli(address, *args, "--prefill", "64")
    assert r.returncode == 2
    assert r.stderr.splitlines()[-1] == (
        f"strata_ray: the engine in namespace {NAMESPACE} ({PRIMARY_NAME}, {COORDINATOR_NAME}) runs with "
        "another configuration; add --replace-actors to remove it")
    r = run_cli(address, *args, "--prefill", "64", "--replace-actors")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["token_ids"] == first["token_ids"]  # the prompt chunk does not change tokens
    assert strata_actors(address) == {}  # not kept: removed at the end of the run


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_removes_our_actors_not_the_cluster(cluster, sig):
    """And SIGTERM (systemd, docker, `timeout`) as Ctrl-C: it was Ray's C++ stack dump and exit 15."""
    address, model = cluster
    p = subprocess.Popen(
        [sys.executable, "-m", "strata_ray.run", "--model", model, "--prompt", "x", "--max-tokens", "100000",
         "--temperature", "1", "--seed", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=client_env(address), cwd=REPO,
        # Ctrl-C as in a terminal, however pytest was started: a shell's background job (`cmd &` without job
        # control) ignores SIGINT, its children inherit that, and Python then never raises KeyboardInterrupt
        # (the run finishes, exit 0: what a CI run started that way saw)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    # Interrupt while it generates: right after the first streamed text (the actors exist by then). With this
    # seed the model samples its end-of-text token after ~390 tokens, a second or two in, so the signal must
    # follow the first text at once: polling the actors' states first took longer than that on a busy host.
    ready, _, _ = select.select([p.stdout], [], [], 300)  # a first run compiles the kernels: minutes
    assert ready and p.stdout.read(1) != "", p.stderr.read() if p.poll() is not None else "no output"
    p.send_signal(sig)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130 and err.splitlines()[-1] == "strata_ray: interrupted", err
    assert strata_actors(address) == {}
    r = run_cli(address, "--model", model, "--prompt", "x", "--max-tokens", "2")  # the cluster still runs
    assert r.returncode == 0, r.stderr


def test_a_live_runs_actors_are_never_reused_or_replaced(cluster):
    """Another run's engine in progress (not kept) has the engine's names too: a second run took its actors
    for kept ones and, with --replace-actors, killed them under it. It is refused in one line now, and the
    first run ends as it would have. (The first run's driver is stopped while the second one looks, so it
    is in progress however fast it would generate.)"""
    address, model = cluster
    p = subprocess.Popen(
        [sys.executable, "-m", "strata_ray.run", "--model", model, "--prompt", "x", "--max-tokens", "64",
         "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=client_env(address), cwd=REPO)
    try:
        deadline = 300
        while deadline > 0 and PRIMARY_NAME not in strata_actors(address):
            select.select([], [], [], 0.5)
            deadline -= 0.5
        p.send_signal(signal.SIGSTOP)
        for extra in ([], ["--replace-actors"]):
            r = run_cli(address, "--model", model, "--prompt", "y", "--max-tokens", "2", *extra)
            assert r.returncode == 2 and r.stderr.splitlines()[-1] == (
                f"strata_ray: the engine in namespace {NAMESPACE} ({PRIMARY_NAME}, {COORDINATOR_NAME}) "
                "belongs to another run in progress on this cluster (not kept with --keep-actors); wait for "
                "it to end, or use --address local"), r.stderr
    finally:
        p.send_signal(signal.SIGCONT)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert len(json.loads(out)["token_ids"]) > 0
    assert strata_actors(address) == {}


# Another run's generation, held in progress: a streaming call that takes one batch, its generator held by
# backpressure after it (the primary keeps its engine until the stream is consumed or dropped)
HOLD = """
import sys, ray
from strata_ray.engine.engine import GenerationRequest
ray.init(address=sys.argv[1], namespace="strata", logging_level="ERROR")
primary = ray.get_actor("strata:primary", namespace="strata")
held = primary.generate_stream.options(num_returns="streaming", _generator_backpressure_num_objects=1)
stream = held.remote(GenerationRequest(prompt_ids=(1, 2, 3), max_tokens=200), "holder")
ray.get(next(stream))
print("holding", flush=True)
sys.stdin.read()
"""


def test_a_kept_engine_busy_with_another_run_is_refused_not_killed(cluster):
    """A run on a kept engine that another run's generation holds: one line and exit 2 (it was told as the
    primary's failure, exit 1), and --replace-actors is refused too (it killed the engine under that run).
    --dashboard on an attached cluster names the cluster's own (it said nothing)."""
    address, model = cluster
    flags = ["--model", model, "--prompt", "x", "--max-tokens", "2"]
    r = run_cli(address, *flags, "--keep-actors", "--dashboard")
    assert r.returncode == 0, r.stderr
    assert "(its dashboard at http://" in r.stderr.splitlines()[0], r.stderr
    holder = subprocess.Popen([sys.executable, "-c", HOLD, address], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**client_env(address), **auth_env()})
    try:
        assert holder.stdout.readline().strip() == "holding", holder.stderr.read()
        same = run_cli(address, *flags)
        replace = run_cli(address, *flags, "--prefill", "64", "--replace-actors")
        assert strata_actors(address) == {PRIMARY_NAME: "ALIVE", COORDINATOR_NAME: "ALIVE"}  # not killed
    finally:
        holder.communicate(timeout=120)  # stdin closed: the holder lets go
    busy = f"strata_ray: the kept engine ({PRIMARY_NAME}) is generating for another run"
    assert same.returncode == 2 and same.stderr.splitlines()[-1] == (
        f"{busy} (it serves one at a time); wait for it to end, or use --address local"), same.stderr
    assert replace.returncode == 2 and replace.stderr.splitlines()[-1] == (
        f"{busy}; --replace-actors removes it once that run ends"), replace.stderr
    r = run_cli(address, *flags, "--prefill", "64", "--replace-actors")  # idle now: removed
    assert r.returncode == 0, r.stderr
    assert strata_actors(address) == {}


ACTOR_ENV = """
import os, sys, ray
ray.init(address=sys.argv[1], namespace="strata", logging_level="ERROR")
primary = ray.get_actor("strata:primary", namespace="strata")
print(ray.get(primary.__ray_call__.remote(lambda self: os.environ.get("STRATA_FUSED_DECODE"))))
"""


def test_the_drivers_switches_reach_the_actors_and_decide_a_kept_engines_reuse(cluster):
    """A switch the kernels read where used, set in the driver's shell only: the attached cluster's actors ran
    in the raylet's environment, without it, and a kept engine was reused whatever the next run set."""
    address, model = cluster
    flags = ["--model", model, "--prompt", "x", "--max-tokens", "2"]

    def run_with(extra_env, *args):
        return subprocess.run([sys.executable, "-m", "strata_ray.run", *flags, *args], capture_output=True,
                              text=True, env={**client_env(address), **extra_env}, cwd=REPO, timeout=300,
                              stdin=subprocess.DEVNULL)

    r = run_with({"STRATA_FUSED_DECODE": "0"}, "--keep-actors")
    assert r.returncode == 0, r.stderr
    seen = subprocess.run([sys.executable, "-c", ACTOR_ENV, address], capture_output=True, text=True,
                          env={**client_env(address), **auth_env()}, timeout=120)
    assert seen.stdout.strip().splitlines()[-1] == "0", seen.stderr
    r = run_with({})
    assert r.returncode == 2 and r.stderr.splitlines()[-1] == (
        f"strata_ray: the engine in namespace {NAMESPACE} ({PRIMARY_NAME}, {COORDINATOR_NAME}) runs with "
        "other STRATA_* switches; add --replace-actors to remove it"), r.stderr
    r = run_with({"STRATA_FUSED_DECODE": "0"})
    assert r.returncode == 0 and "reusing" in r.stderr, r.stderr
    r = run_with({}, "--replace-actors")
    assert r.returncode == 0, r.stderr
    assert strata_actors(address) == {}


MAKE_GROUP = """
import sys, ray
from ray.util.placement_group import placement_group
ray.init(address=sys.argv[1], namespace="strata", logging_level="ERROR")
ray.get(placement_group([{"CPU": 0.01}], name="strata:engine", lifetime="detached").ready(), timeout=60)
"""


def test_the_engines_placement_group_left_or_being_made_is_one_line(cluster):
    """The group with no actors yet (another run's start in the same second, or one a crash left): Ray's own
    error (a C++ line, then "RaySystemError: System error: ...", exit 1) before; one line and exit 2 now, and
    --replace-actors removes it."""
    address, model = cluster
    made = subprocess.run([sys.executable, "-c", MAKE_GROUP, address], capture_output=True, text=True,
                          env={**client_env(address), **auth_env()}, timeout=120)
    assert made.returncode == 0, made.stderr
    flags = ["--model", model, "--prompt", "x", "--max-tokens", "2"]
    r = run_cli(address, *flags)
    assert r.returncode == 2 and r.stderr.splitlines()[-1] == f"strata_ray: {PLACEMENT_GROUP_TAKEN}", r.stderr
    r = run_cli(address, *flags, "--replace-actors")
    assert r.returncode == 0, r.stderr
    assert strata_actors(address) == {}


def test_a_dying_actor_is_reported_in_one_line(cluster, tmp_path):
    """The message run prints for an actor whose process dies (OOM kill, segfault): one line, exit 1."""
    address, _ = cluster
    # the result goes to a file, not stdout: the raylet's own notice of the death is forwarded to the child's
    # stdout by a log thread and landed inside our printed line, between print's pieces (CI, sessions 31, 48)
    result_path = tmp_path / "result.json"
    code = (
        "import json, os, pathlib, ray\n"
        "from strata_ray.actors.launch import describe_failure\n"
        "ray.init(namespace='strata-test', logging_level='ERROR')\n"
        "@ray.remote(num_cpus=0)\n"
        "class Doomed:\n"
        "    def die(self):\n"
        "        os._exit(1)\n"
        "try:\n"
        "    ray.get(Doomed.remote().die.remote())\n"
        "except Exception as e:\n"
        f"    result = json.dumps(describe_failure(e, {PRIMARY_NAME!r}))\n"
        f"    pathlib.Path({str(result_path)!r}).write_text(result)\n"
    )
    env = {**client_env(address), **auth_env()}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert result_path.exists(), r.stdout
    message, exit_code = json.loads(result_path.read_text())
    assert exit_code == 1 and "\n" not in message
    assert message.startswith(f"{PRIMARY_NAME} died: its worker process exited ("), message


def test_kept_actors_are_removed_when_the_model_fails_to_load(cluster, tmp_path, monkeypatch):
    """--keep-actors keeps an engine only once its model has loaded: a file that passes the driver's header
    checks (tensors, shapes, tokenizer keys) but whose tokenizer cannot be built (a merge of no two tokens)
    fails in the primary, and nothing is left holding the cluster's resources."""
    from strata_ray.model import gguf_writer

    address, _ = cluster
    fields = gguf_writer.tokenizer_fields

    def bad_merge(tok):
        f = fields(tok)
        return {**f, "tokenizer.ggml.merges": [*f["tokenizer.ggml.merges"], "a q"]}  # "aq" is no token

    monkeypatch.setattr(gguf_writer, "tokenizer_fields", bad_merge)
    broken = tmp_path / "broken.gguf"
    write_synth(broken, arch="qwen3next", preset="tiny", progress=False)
    r = run_cli(address, "--model", str(broken), "--prompt", "x", "--max-tokens", "2", "--keep-actors")
    assert r.returncode == 2
    want = "strata_ray: tokenizer merge 'a q' does not combine two tokens of the vocabulary"
    assert r.stderr.splitlines()[-1] == want, r.stderr
    assert strata_actors(address) == {}

