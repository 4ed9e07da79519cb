"""Connecting to Ray, placing the engine's actors, and tearing down exactly what we created.

The coordinator and the primary share one STRICT_PACK placement group (the peer joins it later), named
so they show up in the Ray dashboard: `strata:coordinator`, `strata:primary`, namespace `strata`.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from dataclasses import dataclass

from strata_ray.config import ConfigError, EngineConfig, actor_switches, switches_outside_config
from strata_ray.held_interrupts import held_interrupts

NAMESPACE = "strata"
PRIMARY_NAME = "strata:primary"
COORDINATOR_NAME = "strata:coordinator"
PLACEMENT_GROUP_NAME = "strata:engine"
COORDINATOR_CPUS = 0.1  # bookkeeping only; leaves whole cores to the primary
LOCAL_OBJECT_STORE_BYTES = 128 * 1024 * 1024  # tokens and control messages only, never weights
PLACEMENT_TIMEOUT_S = 60.0


# two runs started in the same second both found no engine, and the second one's group clashed with the first
PLACEMENT_GROUP_TAKEN = (f"the engine's placement group ({PLACEMENT_GROUP_NAME}) already exists on this "
                         "cluster: another run is starting its engine, or an earlier one left it; wait for "
                         "that run, or add --replace-actors to remove it")


class LaunchError(RuntimeError):
    """The cluster cannot host the engine (no room, name clash); one line."""


@dataclass
class RaySession:
    started: bool  # True: we started a local Ray instance and shut it down at the end
    address: str
    # the dashboard, http://HOST:PORT: of the instance we started (None: none asked for, or none came up), or
    # the attached cluster's own (None: it runs none). Ray prints its own "View the dashboard at" at INFO,
    # which our logging level without -v (ERROR) hides
    dashboard_url: str | None = None


@dataclass
class Deployment:
    coordinator: object
    primary: object
    placement_group: object | None
    created: bool  # False when we reuse actors kept by an earlier --keep-actors run
    detached: bool


def connect(address: str | None, dashboard: bool, verbose: bool) -> RaySession:
    """Attach to a running cluster, or start a local instance and say so.

    address: None = RAY_ADDRESS if set (must answer), else a cluster running on this machine, else a new
    local instance; 'local' = always a new local instance; 'HOST:PORT' / 'auto' = attach or fail.
    A Ctrl-C during it is held until Ray is up, then this disconnects and raises KeyboardInterrupt: nothing
    half started is left behind (held_interrupts)."""
    check_address(address)
    with held_interrupts() as held:
        session = _connect(address, dashboard, verbose)
    if held.interrupted:
        disconnect(session)
        raise KeyboardInterrupt
    return session


def _connect(address: str | None, dashboard: bool, verbose: bool) -> RaySession:
    quiet = logging.INFO if verbose else logging.ERROR
    target = address or os.environ.get("RAY_ADDRESS")
    if target == "local":
        os.environ.pop("RAY_ADDRESS", None)  # ray.init() would otherwise attach to it
        return _start_local(dashboard, quiet, verbose)
    prepare_token_auth(target)
    import ray

    if target:
        if target != "auto":
            check_reachable(target)
        try:
            context = ray.init(address=target, namespace=NAMESPACE, logging_level=quiet,
                               log_to_driver=verbose)
        except ConnectionError:
            raise LaunchError(
                f"cannot connect to the Ray cluster at {target} (is `ray start --head` running there? "
                "with token authentication set RAY_AUTH_MODE=token and the cluster's token)"
            ) from None
        return _attached(context)
    try:
        context = ray.init(address="auto", namespace=NAMESPACE, logging_level=quiet, log_to_driver=verbose)
        return _attached(context)
    except ConnectionError:  # no cluster on this machine
        return _start_local(dashboard, quiet, verbose)


def _attached(context) -> RaySession:
    """The session of an attached cluster, with its own dashboard's URL where it runs one (--dashboard on an
    attached cluster names it: this run starts none)."""
    import ray

    board = getattr(context, "dashboard_url", None)  # "HOST:PORT", or "" / None
    return RaySession(started=False, address=ray.get_runtime_context().gcs_address,
                      dashboard_url=f"http://{board}" if board else None)


def check_address(address: str | None) -> None:
    """`--address ""` (an unset shell variable, say) is refused, not taken as auto: ConfigError, one line."""
    if address is not None and not address.strip():
        raise ConfigError("--address: an empty address (give auto, local or HOST:PORT)")


def check_reachable(address: str, timeout: float = 5.0) -> None:
    """A HOST:PORT that nothing answers fails here in seconds: ray.init retries such an address for minutes
    (printing the GCS client's warnings), never reaching its ConnectionError. So does one that answers HTTP
    (the dashboard's port, printed beside the GCS's by `ray start`): ray.init waited on it forever, in C++
    code where no Ctrl-C reaches Python. LaunchError, one line."""
    import socket

    scheme = address.split("://", 1)[0].lower() if "://" in address else None
    if scheme in ("http", "https"):  # the Jobs API's RAY_ADDRESS convention: the dashboard, not the GCS
        raise LaunchError(f"Ray address {address} (--address or RAY_ADDRESS) is a dashboard / Jobs API URL "
                          "(for `ray job submit`); give the cluster's GCS address HOST:PORT (`ray start "
                          "--head` prints it, port 6379 by default), 'auto' or 'local'")
    if scheme == "ray":  # it attached and loaded the model, then the first token failed
        raise LaunchError(f"Ray address {address} (--address or RAY_ADDRESS) is a Ray Client address, which "
                          "cannot stream the engine's tokens; run on a node of the cluster with its GCS "
                          "address HOST:PORT (`ray start --head` prints it, port 6379 by default) or 'auto'")
    if scheme is not None:  # another scheme: ray.init reports those itself
        return
    host, sep, port = address.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise LaunchError(f"Ray address {address!r} (--address or RAY_ADDRESS): expected HOST:PORT (e.g. "
                          "10.0.0.5:6379), 'auto' or 'local'")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as conn:
            speaks_http1 = answers_http1(conn)
    except OSError as e:
        reason = f"no answer within {timeout:.0f} s" if isinstance(e, TimeoutError) else (
            e.strerror or str(e))
        raise LaunchError(f"cannot connect to the Ray cluster at {address} ({reason}; is `ray start --head` "
                          "running there?)") from None
    if speaks_http1:
        raise LaunchError(f"{address} is a web server (the Ray dashboard's port?), not a Ray cluster's GCS: "
                          "give the address `ray start --head` prints for the cluster (port 6379 by default)")


HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"  # what a gRPC client (Ray's GCS client) sends first


def answers_http1(conn, wait: float = 2.0) -> bool:
    """Whether the server on conn answers an HTTP/2 connection preface in text: an HTTP/1 status line
    ("HTTP/1.1 505 ...", aiohttp's, the dashboard's) or an error page (Python's http.server sends its HTML
    bare), a web server's answer. A GCS (gRPC) answers in HTTP/2 frames, whose first byte is a length's
    high byte (0 for its SETTINGS); a silent or closing server, or a TLS one (a binary alert), is left for
    ray.init to judge (False)."""
    try:
        conn.settimeout(wait)
        conn.sendall(HTTP2_PREFACE)
        first = conn.recv(1)
    except OSError:  # a timeout too
        return False
    return bool(first) and 0x20 <= first[0] < 0x7F


def _start_local(dashboard: bool, logging_level: int, verbose: bool) -> RaySession:
    import ray

    context = ray.init(
        address="local",  # never a cluster that `ray start` left on this machine
        namespace=NAMESPACE,
        include_dashboard=dashboard,
        object_store_memory=LOCAL_OBJECT_STORE_BYTES,
        logging_level=logging_level,
        log_to_driver=verbose,
    )
    board = getattr(context, "dashboard_url", None) if dashboard else None  # "HOST:PORT", or "" / None
    return RaySession(started=True, address=ray.get_runtime_context().gcs_address,
                      dashboard_url=f"http://{board}" if board else None)


def prepare_token_auth(address: str | None) -> None:
    """For an explicit cluster address (the argument, else RAY_ADDRESS; not 'local' or 'auto'), take the
    user's Ray token where there is one (_use_token_auth_if_available). Must run before Ray is imported."""
    target = address or os.environ.get("RAY_ADDRESS")
    if target and target not in ("local", "auto"):
        _use_token_auth_if_available()


def _use_token_auth_if_available() -> None:
    """Ray (>= 2.5x) auto-enables token auth only for clusters it finds itself ('auto'); for an explicit
    address it needs RAY_AUTH_MODE=token. When the user has a token and did not choose a mode, use it, as
    `ray.init(address='auto')` would. Must run before ray is imported (its config caches the mode)."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    token_file = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    if os.environ.get("RAY_AUTH_TOKEN") or os.path.isfile(token_file):
        os.environ["RAY_AUTH_MODE"] = "token"


def cluster_device(cfg: EngineConfig) -> str:
    """'auto' -> cuda when the cluster has GPUs (the primary may sit on another node than the driver)."""
    import ray

    if cfg.device != "auto":
        if cfg.device == "cuda" and not ray.cluster_resources().get("GPU", 0):
            raise ConfigError("--device cuda: the Ray cluster has no GPU (use --device cpu)")
        device = cfg.device
    else:
        device = "cuda" if ray.cluster_resources().get("GPU", 0) >= 1 else "cpu"
    unused = cpu_unused_flags(cfg) if device == "cpu" else []
    if unused:  # accepted, and silently nothing, before
        sys.stderr.write(f"strata_ray: note: {', '.join(unused)} has no effect on a CPU run\n")
    return device


def cpu_unused_flags(cfg: EngineConfig) -> list[str]:
    """The flags set that a CPU run does not read. A CPU primary's automatic cache is 0 slots, unless
    --vram-budget-mib gives it that much host memory (less --vram-reserve-mib: slot_cache.cache_slots), so
    the reserve alone is nothing, either is nothing beside an explicit --expert-cache, and a profile that
    fills no slot is nothing (--expert-profile-save still saves what the run learned)."""
    default = EngineConfig()
    reserve_set = cfg.vram_reserve_mib != default.vram_reserve_mib
    unused = []
    if cfg.expert_cache is not None:
        unused += ["--vram-budget-mib"] * (cfg.vram_budget_mib is not None)
        unused += ["--vram-reserve-mib"] * reserve_set
    elif cfg.vram_budget_mib is None:
        unused += ["--vram-reserve-mib"] * reserve_set
    no_slots = cfg.expert_cache == 0 or (cfg.expert_cache is None and cfg.vram_budget_mib is None)
    if no_slots and cfg.expert_profile is not None and not cfg.resumes_profile:
        unused.append("--expert-profile")
    return unused


def _named(name: str):
    import ray

    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None


def find_existing(cfg: EngineConfig, replace: bool) -> Deployment | None:
    """Actors left by an earlier `--keep-actors` run: reused when their config equals ours; with
    replace=True removed (with their placement group) when it differs or only one of them is left."""
    import ray

    primary, coordinator = _named(PRIMARY_NAME), _named(COORDINATOR_NAME)
    if primary is None and coordinator is None:
        if replace:  # a group left without its actors (PLACEMENT_GROUP_TAKEN's case) goes too
            remove_kept()
        return None
    if coordinator is not None and not _kept(coordinator):  # a live run's: never ours to reuse or kill
        raise LaunchError(
            f"the engine in namespace {NAMESPACE} ({PRIMARY_NAME}, {COORDINATOR_NAME}) belongs to another "
            "run in progress on this cluster (not kept with --keep-actors); wait for it to end, or use "
            "--address local")
    if primary is not None and coordinator is not None:
        if ray.get(coordinator.get_config.remote()) != cfg:
            problem = "runs with another configuration"
        elif _switches(primary) != switches_outside_config(actor_switches(os.environ)):
            problem = "runs with other STRATA_* switches"
        else:
            return Deployment(coordinator, primary, None, created=False, detached=True)
    else:
        problem = "is left incomplete (one of its actors died)"
    if not replace:
        raise LaunchError(
            f"the engine in namespace {NAMESPACE} ({PRIMARY_NAME}, {COORDINATOR_NAME}) {problem}; "
            "add --replace-actors to remove it"
        )
    if primary is not None and _busy(primary):  # it was killed under the other run's generation
        raise LaunchError(f"the kept engine ({PRIMARY_NAME}) is generating for another run; --replace-actors "
                          "removes it once that run ends")
    remove_kept()
    return None


def _switches(primary) -> dict[str, str] | None:
    """The kept primary's switches that its config does not carry (the driver's own where it cannot say: an
    earlier version's primary, reused regardless as before)."""
    import ray

    try:
        return switches_outside_config(ray.get(primary.switches.remote(), timeout=30))
    except Exception:
        return switches_outside_config(actor_switches(os.environ))


def _busy(primary) -> bool:
    """Whether a kept primary is generating (False for one that cannot answer: dead, or an earlier version's
    without busy())."""
    import ray

    try:
        return bool(ray.get(primary.busy.remote(), timeout=30))
    except Exception:
        return False


def _kept(coordinator) -> bool:
    """The coordinator's kept flag; True for a coordinator without one (an earlier version's, which only
    --keep-actors runs left behind) or one that cannot answer (dead: its engine is incomplete)."""
    import ray

    try:
        return bool(ray.get(coordinator.kept.remote(), timeout=30))
    except Exception:
        return True


def remove_kept() -> None:
    """Kill the named engine actors and remove the engine's placement group, whoever created them."""
    import ray
    from ray.util.placement_group import get_placement_group, remove_placement_group

    for name in (PRIMARY_NAME, COORDINATOR_NAME):
        actor = _named(name)
        if actor is not None:
            ray.kill(actor, no_restart=True)
    try:
        remove_placement_group(get_placement_group(PLACEMENT_GROUP_NAME))
    except ValueError:  # no such group
        pass


def launch(cfg: EngineConfig, keep: bool) -> Deployment:
    """Create the placement group and both actors. keep=True makes them outlive this driver."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from strata_ray.actors.coordinator import Coordinator
    from strata_ray.actors.primary import Primary

    lifetime = "detached" if keep else None
    switches = actor_switches(os.environ)  # the driver's, where the actors' raylet may have none of them
    runtime_env = {"env_vars": switches} if switches else None
    primary_bundle = {"CPU": 1.0, **({"GPU": 1.0} if cfg.device == "cuda" else {})}
    bundles = [{"CPU": COORDINATOR_CPUS}, primary_bundle]
    short = cluster_shortfall(bundles, ray.cluster_resources())
    if short:  # no waiting PLACEMENT_TIMEOUT_S for room that the whole cluster does not have
        raise LaunchError(f"the cluster cannot hold the engine: it needs {_bundle_text(bundles)} on one "
                          f"node, and the whole cluster has {short}")
    try:
        pg = placement_group(bundles, strategy="STRICT_PACK", name=PLACEMENT_GROUP_NAME, lifetime=lifetime)
    except Exception as e:  # Ray's RaySystemError, which printed as "System error: Failed to create ..."
        if "already exists" not in str(e):
            raise
        raise LaunchError(PLACEMENT_GROUP_TAKEN) from None
    ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        remove_placement_group(pg)
        raise LaunchError(
            f"the cluster has no node with room for the engine within {PLACEMENT_TIMEOUT_S:.0f} s "
            f"(needs {_bundle_text(bundles)} on one node; "
            f"cluster has {_bundle_text([ray.available_resources()])} free)"
        )

    def place(index: int):
        return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)

    try:
        coordinator = (
            ray.remote(Coordinator)
            .options(name=COORDINATOR_NAME, namespace=NAMESPACE, lifetime=lifetime, num_cpus=COORDINATOR_CPUS,
                     scheduling_strategy=place(0), max_restarts=0, runtime_env=runtime_env)
            .remote(cfg, keep)
        )
        primary = (
            ray.remote(Primary)
            .options(name=PRIMARY_NAME, namespace=NAMESPACE, lifetime=lifetime, num_cpus=1,
                     num_gpus=1 if cfg.device == "cuda" else 0, scheduling_strategy=place(1),
                     max_concurrency=2, max_restarts=0, runtime_env=runtime_env)
            .remote(cfg, coordinator, switches)
        )
    except ValueError as e:  # name already taken: another run is creating its actors right now
        remove_placement_group(pg)
        raise LaunchError(f"cannot create the engine's actors: {e}") from None
    return Deployment(coordinator, primary, pg, created=True, detached=keep)


def cluster_gone(session: RaySession | None, timeout: float = 1.0, within: float = 0.0) -> bool:
    """Whether the attached cluster's GCS no longer takes connections (the cluster was stopped under the
    run): every call to Ray would then wait ~60 s for it, deaf to Ctrl-C, before Ray ends the process
    itself. within: seconds to keep looking (`ray stop` kills the workers, whose loss the run sees first,
    a few seconds before the GCS). Never for a local instance we started (ours to shut down) or no session."""
    import socket
    import time

    if session is None or session.started:
        return False
    host, _, port = session.address.rpartition(":")
    deadline = time.monotonic() + within
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
        except (OSError, ValueError):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.25)


def exit_if_cluster_gone(session: RaySession | None, e: BaseException, report) -> None:
    """Where a failure `e` came from the attached cluster going away, report(one line) and exit at once with
    status 1: Ray's calls and its exit hooks would wait ~60 s for the GCS, deaf to Ctrl-C, then print their
    own lines, and nothing of ours is left to clean up there. An actor's loss (its process or node gone),
    which a stopped cluster gives first, earns a few seconds' look at the cluster before it is blamed."""
    from ray.exceptions import RayActorError

    if not cluster_gone(session, within=3.0 if isinstance(e, RayActorError) else 0.0):
        return
    report(f"the Ray cluster at {session.address} went away (its GCS no longer answers; was it stopped?)")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def teardown(dep: Deployment | None, keep: bool, session: RaySession | None = None) -> None:
    """Kill what this run created (unless kept). Never touches actors or clusters we did not create. A
    Ctrl-C during it is held until it is done, then dropped, as disconnect's. Nothing where the session's
    cluster went away (its actors and placement group went with it)."""
    if dep is None or not dep.created or keep or cluster_gone(session):
        return
    import ray
    from ray.util.placement_group import remove_placement_group

    with held_interrupts():
        for actor in (dep.primary, dep.coordinator):
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead: nothing left to clean
                pass
        if dep.placement_group is not None:
            try:
                remove_placement_group(dep.placement_group)
            except Exception:
                pass


def disconnect(session: RaySession | None) -> None:
    """Shut down Ray only if we started it; an attached cluster keeps running. A Ctrl-C during the shutdown
    is held until it is done, then dropped: the run's end is already under way, and its one line or exit
    code stand (a second Ctrl-C still raises)."""
    if session is not None and session.started:
        import ray

        with held_interrupts():
            ray.shutdown()


def cluster_shortfall(bundles: list[dict], total: dict) -> str | None:
    """What the cluster's total resources lack for the bundles (as "CPU 1 in all"), or None where the
    totals suffice (a node may still lack room: the placement's wait says so)."""
    lacking = [k for k, v in sorted(_cpu_gpu(bundles).items()) if total.get(k, 0.0) < v - 1e-9]
    return " + ".join(f"{k} {total.get(k, 0.0):g}" for k in lacking) + " in all" if lacking else None


def _cpu_gpu(bundles: list[dict]) -> dict[str, float]:
    """The CPUs and GPUs of resource dicts, summed (Ray's resource dicts hold memory, node tags and more)."""
    total: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            if k in ("CPU", "GPU"):
                total[k] = total.get(k, 0.0) + v
    return total


def _bundle_text(bundles: list[dict]) -> str:
    return " + ".join(f"{k} {v:g}" for k, v in sorted(_cpu_gpu(bundles).items())) or "nothing"


def describe_failure(e: BaseException, actor: str | None) -> tuple[str, int]:
    """One line and an exit code for any failure of a run: 2 for what the user must fix (flag, file, request,
    cluster), 1 for an engine failure (an actor that died or raised)."""
    from ray.exceptions import OutOfMemoryError, RayActorError

    from strata_ray.experts.profile import ProfileError
    from strata_ray.model.hparams import ModelFormatError

    cause = ray_cause(e)
    who = actor or "the driver"
    user_errors = (ConfigError, ModelFormatError, ProfileError, LaunchError, ValueError)
    if isinstance(cause, user_errors) and _is_user_error(cause):
        return first_line(cause), 2
    if isinstance(cause, OutOfMemoryError):
        return f"{who} was killed by Ray's memory monitor (out of memory)", 1
    if isinstance(cause, RayActorError):
        return f"{who} died: {death_reason(cause)}", 1
    if cause is not e or actor is not None:
        return f"{who} failed: {type(cause).__name__}: {first_line(cause)}", 1
    return f"{type(cause).__name__}: {first_line(cause)}", 1


def ray_cause(e: BaseException) -> BaseException:
    """The exception an actor's task raised, out of Ray's wrappers (whose message starts with a header line
    naming the task, and which pass isinstance for the cause's class); e itself where Ray did not wrap it."""
    from ray.exceptions import RayTaskError

    cause = e
    while isinstance(cause, RayTaskError) and getattr(cause, "cause", None) is not None:
        cause = cause.cause
    return cause


def failed_actor(e: BaseException, called: str) -> str | None:
    """Who a failure is told of, for a caller that drives `called` (bench: the primary) without tracking
    each call as `run` does: the actor Ray's error names as dead (a named actor's death says "name: ..."; the
    primary's own call may fail on the coordinator's), else `called` for any other error Ray raised (the
    actor's task raised, or it died unnamed); None for the caller's own exception (describe_failure: the
    driver). Before, bench passed None throughout and told the primary's death as "the driver died"."""
    from ray.exceptions import RayActorError, RayError

    cause = ray_cause(e)
    if isinstance(cause, RayActorError):
        named = re.search(r"^\s*name: (\S+)\s*$", str(getattr(cause, "error_msg", "") or ""), re.MULTILINE)
        if named:
            return named[1]
    return called if isinstance(e, RayError) or isinstance(cause, RayError) else None


def _is_user_error(cause: BaseException) -> bool:
    """ValueErrors are user errors only when they are the engine's request errors (one-line messages)."""
    from strata_ray.engine.engine import RequestError
    from strata_ray.engine.generate import GenerationError
    from strata_ray.engine.sampling import SamplingError
    from strata_ray.model.tokenizer import ChatTemplateError

    if isinstance(cause, ValueError):  # a chat template that refuses the messages: the request's fault
        return isinstance(cause, (RequestError, GenerationError, SamplingError, ChatTemplateError))
    return True


def death_reason(e: BaseException) -> str:
    """The useful part of Ray's multi-line actor-death message, on one line."""
    text = " ".join(str(getattr(e, "error_msg", "") or e).split())
    init_cause = getattr(e, "cause", None)  # actor __init__ raised
    if init_cause is not None and init_cause is not e:
        return f"its constructor raised {type(init_cause).__name__}: {first_line(init_cause)}"
    if "ray.kill" in text or "killed by `ray.kill`" in text:
        return "killed by ray.kill"
    m = re.search(r"Worker exit type: (\w+) Worker exit detail: (.*?)(?: There are| Some common|$)", text)
    if m:
        return f"its worker process exited ({m.group(1)}: {m.group(2).strip()[:200]})"
    return text[:300] or type(e).__name__


def first_line(e: BaseException) -> str:
    """The first non-blank line of an exception's message (its type name when it has none)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[0] if lines else type(e).__name__
