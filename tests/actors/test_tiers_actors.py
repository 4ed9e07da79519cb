"""Expert tiers through the real runtime: `python -m strata_ray.run` with the primary and the coordinator
as Ray actors, on the CPU, where the cache "slots" are a second CPU tier running the same kernels.

Greedy token ids must not depend on placement (no cache, a partial cache filled from a profile, every
pair cached, adaptive rounds planned by the coordinator actor); `--expert-profile-save` writes the
learned STRP; a profile of another shape is refused before Ray starts; the load progress bars reach the
driver's stderr only when it is a terminal; the cache's fill line reaches the user once.

One Ray cluster (`ray start --head --block`, in its own session) and one tiny model for the module: each
run attaches to it, which costs seconds instead of a local instance's startup per run.
"""

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading
import time
import urllib.request

import numpy as np
import pytest

from strata_ray.experts.profile import Profile, check_shape, read_profile, write_profile
from strata_ray.model.gguf_file import GGUFFile
from strata_ray.model.synth import write_synth
from tests.actors.ray_head import REPO, auth_env, client_env, free_port, ray_head

PROMPT_IDS = "5,17,101,42,250,7,64,3"
MAX_TOKENS = 10
FILL_LINE = re.compile(
    r"^strata_ray: pre-filled (\d+) of (\d+) slots from (the profile|the default order) in [\d.]+ s "
    r"\(\d+ MB/s\); slot 0 verified$"
)


METRICS_PORT = free_port()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tiers_actors")
    model = tmp / "tiny.gguf"
    def write_model():
        write_synth(model, arch="qwen3next", preset="tiny", progress=False)

    with ray_head(tmp, while_starting=write_model, metrics_port=METRICS_PORT) as address:
        yield address, str(model)


def run_cli(address, *args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "strata_ray.run", "--prompt-ids", PROMPT_IDS, "--max-tokens", str(MAX_TOKENS),
         "--json", *args],
        capture_output=True, text=True, env=client_env(address), cwd=REPO, timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def run_cli_on_a_terminal(address, *args, timeout=300) -> tuple[int, str, str]:
    """run with stderr on a pseudo-terminal (stdout a pipe): (exit code, stdout, what the terminal got)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # tqdm sizes bars to it
    got = bytearray()

    def drain():
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: every writer closed the terminal
                return
            if not chunk:
                return
            got.extend(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        p = subprocess.run(
            [sys.executable, "-m", "strata_ray.run", "--prompt-ids", PROMPT_IDS, "--max-tokens",
             str(MAX_TOKENS), "--json", *args],
            stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL, text=True,
            env=client_env(address), cwd=REPO, timeout=timeout,
        )
    finally:
        os.close(slave)
        reader.join(timeout=10)
        os.close(master)
    return p.returncode, p.stdout, got.decode("utf-8", "replace")


def pairs(model: str) -> int:
    hp = GGUFFile(model).hparams
    return hp.n_layer * hp.n_expert


@pytest.fixture(scope="module")
def runs(cluster, tmp_path_factory):
    """The placements, each through `run`: name -> (CompletedProcess or terminal result, parsed JSON)."""
    address, model = cluster
    tmp = tmp_path_factory.mktemp("profiles")
    n_pairs = pairs(model)
    partial = n_pairs // 3
    learned, relearned = str(tmp / "learned.strp"), str(tmp / "relearned.strp")
    out = {"partial": partial, "learned": learned, "relearned": relearned}
    base = ("--model", model, "--device", "cpu")
    for name, args in {
        "cache 0": ("--expert-cache", "0"),
        # adaptive rounds planned by the coordinator; the learned profile saved at the end
        "adaptive": ("--expert-cache", str(partial), "--adapt-every", "1", "--adapt-swaps", "8",
                     "--expert-profile-save", learned),
        # a later run filled from that profile (no rounds: its residents are exactly the profile's head)
        "profile": ("--expert-cache", str(partial), "--expert-profile", learned, "--adapt-every", "0",
                    "--expert-profile-save", relearned),
    }.items():
        r = run_cli(address, *base, *args)
        assert r.returncode == 0, r.stderr
        out[name] = (r, json.loads(r.stdout))
    code, stdout, terminal = run_cli_on_a_terminal(address, *base, "--expert-cache", str(n_pairs))
    assert code == 0, terminal
    out["all cached"] = (terminal, json.loads(stdout))
    return out


def test_greedy_token_ids_do_not_depend_on_placement(runs):
    ids = {name: runs[name][1]["token_ids"] for name in ("cache 0", "adaptive", "profile", "all cached")}
    assert len(ids["cache 0"]) == MAX_TOKENS
    assert len({tuple(v) for v in ids.values()}) == 1, ids


def test_json_reports_the_tiers(runs):
    none, everything = runs["cache 0"][1]["experts"], runs["all cached"][1]["experts"]
    assert none["slot_hits"] == 0 and none["cpu_entries"] > 0
    # no PCIe tier on the CPU backend (the GPU's share of the misses, STRATA_PCIE_SHARE, needs CUDA)
    assert none["tier_rates"] == {"cache": 0.0, "cpu": 1.0, "pcie": 0.0}
    assert everything["cpu_entries"] == 0
    assert everything["tier_rates"] == {"cache": 1.0, "cpu": 0.0, "pcie": 0.0}
    assert everything["swaps"] == 0 and everything["host_ms_per_token"] > 0
    partial = runs["profile"][1]["experts"]
    assert 0 < partial["tier_rates"]["cache"] < 1 and partial["swaps"] == 0
    for name in ("cache 0", "all cached", "profile"):
        assert runs[name][1]["experts"]["coordinator"]["rounds"] == 0  # no rounds without a partial cache


def _scrape(name: str, timeout: float = 30.0) -> list[tuple[dict, float]]:
    """The node's Prometheus series of the Ray metric `name` (ray.util.metrics add the "ray_" prefix):
    (labels, value) each; waits until at least one is there."""
    pattern = re.compile(r"^ray_" + name + r"\{(.*)\} (\S+)$")
    deadline = time.monotonic() + timeout
    while True:
        body = urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10).read().decode()
        series = [(dict(re.findall(r'(\w+)="([^"]*)"', m[1])), float(m[2]))
                  for m in map(pattern.match, body.splitlines()) if m]
        if series or time.monotonic() > deadline:
            return series
        time.sleep(0.5)


def test_the_tiers_reach_rays_metrics(runs, cluster):
    """Each run's primary pushes its tier counters to ray.util.metrics at the end of its request (10 tokens:
    fewer than a flush's 16 windows), where the node's Prometheus endpoint serves them: a series a worker,
    each run's counters equal to its JSON; and the share of each tier as a gauge tagged by tier (read just
    after a run of its own: the node drops a dead worker's gauges after a while, not its counters)."""
    cpu = [v for _, v in _scrape("strata_expert_cpu_entries_total")]
    assert runs["cache 0"][1]["experts"]["cpu_entries"] in cpu, cpu
    hits = [v for _, v in _scrape("strata_expert_slot_hits_total")]
    assert runs["all cached"][1]["experts"]["slot_hits"] in hits, hits
    swaps = [v for _, v in _scrape("strata_expert_swaps_total")]
    assert runs["adaptive"][1]["experts"]["swaps"] in swaps, swaps
    address, model = cluster
    r = run_cli(address, "--model", model, "--device", "cpu", "--expert-cache", "0")
    assert r.returncode == 0, r.stderr
    deadline = time.monotonic() + 30
    while True:  # the fresh run's series: every entry on the CPU
        rates = _scrape("strata_expert_tier_rate")
        workers = {labels["WorkerId"] for labels, v in rates if labels["tier"] == "cpu" and v == 1.0}
        if workers or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(workers) == 1, rates
    worker = workers.pop()
    mine = {labels["tier"]: v for labels, v in rates if labels["WorkerId"] == worker}
    assert mine == {"cache": 0.0, "cpu": 1.0, "pcie": 0.0}
    assert [v for labels, v in _scrape("strata_expert_hit_rate") if labels["WorkerId"] == worker] == [0.0]
    host = [v for labels, v in _scrape("strata_expert_host_ms_per_token") if labels["WorkerId"] == worker]
    assert len(host) == 1 and host[0] > 0


def test_adaptive_rounds_run_in_the_coordinator_actor(runs):
    r, doc = runs["adaptive"]
    experts = doc["experts"]
    assert experts["swaps"] > 0, experts
    coordinator = experts["coordinator"]  # CoordinatorRounds: the coordinator planned every round
    assert coordinator["rounds"] > 0 and coordinator["swaps"] >= experts["swaps"], experts
    # every window's counts reached the coordinator before the request ended (--adapt-every 1: each window
    # closes a round), however late its answers came
    assert coordinator["windows"] == experts["windows"] > 0, experts
    summary = r.stderr.splitlines()[-1]
    swaps = int(re.search(r"experts: [\d.]+% cache hits, \d+ CPU entries, (\d+) swaps, host", summary)[1])
    assert swaps == experts["swaps"]


ROUNDS_SCRIPT = """
import json, numpy as np, ray
from strata_ray.actors.coordinator import Coordinator
from strata_ray.config import EngineConfig
from strata_ray.experts.tiered import CoordinatorRounds

ray.init(namespace="strata-test-rounds", logging_level="ERROR")
coordinator = ray.remote(Coordinator).remote(EngineConfig(adapt_every=1, adapt_swaps=4))
ray.get(coordinator.configure_rounds.remote(1, 4))
rounds = CoordinatorRounds(coordinator, 1, 4, 1)
resident = np.array([[True, True, False, False]])
first = rounds.window_done(np.array([[0, 0, 0, 5]]), resident, False)  # round 1 sent
# round 2's window closes at once: round 1's answer is (most likely) still on its way, so round 2 waits
second = rounds.window_done(np.array([[0, 0, 4, 0]]), resident, False)
drained = rounds.drain()  # round 1's swap
after = resident.copy()
for swap in second + drained:  # round 1's swap, however soon its answer came
    after[swap.layer, swap.victim], after[swap.layer, swap.candidate] = False, True
flushed = rounds.flush(after)  # the end of the request: round 2 planned now, on the placement after round 1
print(json.dumps({"returned": [[s.layer, s.candidate, s.victim] for s in first + second + drained + flushed],
                  "status": ray.get(coordinator.status.remote())["adaptive"]}))
"""


def test_rounds_still_due_at_a_requests_end_are_planned_before_it_ends(cluster):
    """CoordinatorRounds against the real coordinator actor: a round whose window closed while the answer
    before it was still on its way is sent by flush() at the end of the request (finish()), planned on the
    placement after the earlier round's swaps, so every window's counts reach the coordinator in the
    request that routed them. Expert 3 (hot in round 1) replaces expert 0, then expert 2 replaces expert 1."""
    address, _ = cluster
    r = subprocess.run([sys.executable, "-c", ROUNDS_SCRIPT], capture_output=True, text=True,
                       env={**client_env(address), **auth_env()}, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout.splitlines()[-1])
    assert doc["status"] == {"rounds": 2, "swaps": 2, "windows": 2}, doc
    assert doc["returned"] == [[0, 3, 0], [0, 2, 1]], doc


def test_profile_save_writes_a_profile_for_the_model(runs, cluster):
    _, model = cluster
    hp = GGUFFile(model).hparams
    learned = read_profile(runs["learned"])
    check_shape(learned, hp)
    assert learned.n_ranked == hp.n_layer * hp.n_expert
    # the run filled from it had exactly its head resident (no rounds), and saves those pairs first
    head = set(learned.pair_ids()[: runs["partial"]].tolist())
    relearned = read_profile(runs["relearned"])
    assert set(relearned.pair_ids()[: runs["partial"]].tolist()) == head
    assert not [f for f in os.listdir(os.path.dirname(runs["learned"])) if f.endswith(".tmp")]


def test_fill_line_reaches_the_user_once(runs):
    lines = [ln for ln in runs["profile"][0].stderr.splitlines() if "pre-filled" in ln]
    assert len(lines) == 1 and FILL_LINE.match(lines[0]), lines
    m = FILL_LINE.match(lines[0])
    assert (int(m[1]), int(m[2]), m[3]) == (runs["partial"], runs["partial"], "the profile")
    assert FILL_LINE.match(next(ln for ln in runs["adaptive"][0].stderr.splitlines() if "pre-filled" in ln))
    assert "pre-filled" not in runs["cache 0"][0].stderr  # no slots: nothing to say


def test_no_progress_bars_when_stderr_is_not_a_terminal(runs):
    for name in ("cache 0", "adaptive", "profile"):
        err = runs[name][0].stderr
        assert "\r" not in err and "loading the model" not in err and "slot/s" not in err, err
        assert all(ln.startswith("strata_ray: ") for ln in err.splitlines()), err


def test_progress_bars_on_a_terminal(runs):
    terminal = runs["all cached"][0]
    assert "strata_ray: loading the model" in terminal
    assert re.search(r"strata_ray: filling the expert cache: +100%\|[^|]*\| (\d+)/\1 ", terminal), terminal
    assert len(re.findall(r"pre-filled \d+ of \d+ slots", terminal)) == 1
    assert "from the default order" in terminal


def test_a_profile_for_another_shape_is_refused_before_ray(cluster, tmp_path):
    _, model = cluster
    hp = GGUFFile(model).hparams
    other = tmp_path / "other.strp"
    write_profile(other, Profile(hp.n_layer + 1, hp.n_expert, np.array([(0, 0), (hp.n_layer, 1)])))
    started = time.monotonic()
    r = run_cli(None, "--address", "local", "--model", model, "--expert-profile", str(other))
    assert r.returncode == 2
    assert r.stderr == (
        f"strata_ray: expert profile {other} is for {hp.n_layer + 1} layers x {hp.n_expert} experts, "
        f"but the model has {hp.n_layer} layers x {hp.n_expert} experts\n"
    )
    assert r.stdout == "" and time.monotonic() - started < 15  # no Ray instance was started


def test_a_profile_save_into_a_missing_folder_is_refused_before_ray(cluster, tmp_path):
    _, model = cluster
    target = tmp_path / "missing" / "learned.strp"
    r = run_cli(None, "--address", "local", "--model", model, "--expert-profile-save", str(target))
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == f"strata_ray: --expert-profile-save: folder not found: {target.parent}\n"


def test_a_profile_error_in_the_primary_is_the_users():
    from strata_ray.actors.launch import PRIMARY_NAME, describe_failure
    from strata_ray.experts.profile import ProfileError

    line = "expert profile p.strp is for 3 layers x 8 experts, but the model has 4 layers x 8 experts"
    assert describe_failure(ProfileError(line), PRIMARY_NAME) == (line, 2)
