"""launch's plain helpers (the Ray paths are tested against real clusters in test_attach)."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from strata_ray.actors.launch import cpu_unused_flags
from strata_ray.config import EngineConfig


def test_the_flags_a_cpu_run_notes_are_those_it_does_not_read():
    """cluster_device notes them when the run lands on the CPU. --vram-budget-mib sizes a CPU primary's
    cache in host memory (less the reserve): noted as unused before, which was false."""
    cfg = EngineConfig()
    assert cpu_unused_flags(cfg) == []
    assert cpu_unused_flags(replace(cfg, vram_budget_mib=100)) == []
    assert cpu_unused_flags(replace(cfg, vram_budget_mib=100, vram_reserve_mib=0)) == []
    assert cpu_unused_flags(replace(cfg, vram_reserve_mib=0)) == ["--vram-reserve-mib"]
    assert cpu_unused_flags(replace(cfg, expert_cache=8, vram_budget_mib=100, vram_reserve_mib=0)) == [
        "--vram-budget-mib", "--vram-reserve-mib"]
    assert cpu_unused_flags(replace(cfg, expert_profile="p.strp")) == ["--expert-profile"]  # 0 slots
    assert cpu_unused_flags(replace(cfg, expert_profile="p.strp", expert_cache=0)) == ["--expert-profile"]
    assert cpu_unused_flags(replace(cfg, expert_profile="p.strp", expert_cache=4)) == []
    assert cpu_unused_flags(replace(cfg, expert_profile="p.strp", vram_budget_mib=100)) == []


def test_a_ctrl_c_while_ray_starts_leaves_nothing_running():
    """A SIGINT inside ray.init, after Ray's head processes started (sent from Node.start_ray_processes, so
    the timing is the code's, not a clock's): connect finishes the start, shuts Ray down again and raises
    KeyboardInterrupt, with no Ray process left among the caller's children (a KeyboardInterrupt there left
    3-5 of them running: a user saw a segfault at exit)."""
    import subprocess
    import sys

    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc to list the children from")
    code = """
import glob, os, signal
import ray._private.node as node
from strata_ray.actors import launch
import ray

def children():  # living processes whose parent is this one, from /proc (field 4 of stat: the parent)
    out = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = open(stat).read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            out.append(stat)
    return out

start = node.Node.start_ray_processes
def interrupted_start(self, *args, **kwargs):
    os.kill(os.getpid(), signal.SIGINT)  # the head processes (the GCS) run by now
    return start(self, *args, **kwargs)
node.Node.start_ray_processes = interrupted_start
try:
    launch.connect("local", False, False)
    print("connected")
except KeyboardInterrupt:
    print("interrupted", ray.is_initialized(), len(children()))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert (r.returncode, r.stdout.strip()) == (0, "interrupted False 0"), (r.stdout, r.stderr[-2000:])


def test_a_chat_template_that_refuses_the_messages_is_the_users_fault():
    """raise_exception in a model's template (say "only system roles"): exit 2 as serve's 400, not 1 as an
    engine failure; a ValueError of the engine's own stays an engine failure."""
    from ray.exceptions import RayTaskError

    from strata_ray.actors.launch import PRIMARY_NAME, describe_failure
    from strata_ray.model.tokenizer import ChatTemplateError

    line = "chat template: only system roles"
    assert describe_failure(ChatTemplateError(line), PRIMARY_NAME) == (line, 2)
    wrapped = RayTaskError("generate", "traceback", ChatTemplateError(line))
    assert describe_failure(wrapped, PRIMARY_NAME)[1] == 2
    assert describe_failure(ValueError("a bug"), PRIMARY_NAME)[1] == 1


FAILED_ACTOR_SCRIPT = """
import json, time, ray
from ray.exceptions import RayTaskError
from strata_ray.actors.launch import describe_failure, failed_actor

ray.init(address="local", namespace="strata-test-failed", logging_level="ERROR", include_dashboard=False)

@ray.remote(num_cpus=0)
class Worker:
    def wait(self):
        time.sleep(60)

def told(make_failure):
    try:
        make_failure()
    except Exception as e:
        actor = failed_actor(e, "strata:primary")
        return [actor, describe_failure(e, actor)[0]]

def killed(name):  # a call in flight when the actor is killed, as the bench's generation is
    w = Worker.options(name=name).remote() if name else Worker.remote()
    ref = w.wait.remote()
    time.sleep(1)
    ray.kill(w)
    ray.get(ref)

def own_bug():
    raise ValueError("a bug of the driver's own")

def wrapped():  # the primary's task failing on the coordinator's death: Ray wraps that one in its own error
    try:
        killed("strata:coordinator")
    except Exception as e:
        raise RayTaskError("generate_stream", "traceback", e) from None

print(json.dumps([told(lambda: killed("strata:primary")), told(lambda: killed(None)), told(own_bug),
                  told(wrapped)]))
"""


def test_a_failure_is_told_of_the_actor_ray_names_as_dead():
    """failed_actor (bench: the primary is the actor it drives): the actor Ray's error names as dead, the
    driven actor for an unnamed death, and nobody for the caller's own exception (the driver's)."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a local instance of its own
    r = subprocess.run([sys.executable, "-c", FAILED_ACTOR_SCRIPT], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    primary, unnamed, own, coordinator = json.loads(r.stdout.splitlines()[-1])
    assert primary == ["strata:primary", "strata:primary died: killed by ray.kill"]
    assert unnamed == ["strata:primary", "strata:primary died: killed by ray.kill"]
    assert own == [None, "ValueError: a bug of the driver's own"]
    assert coordinator == ["strata:coordinator", "strata:coordinator died: killed by ray.kill"]
