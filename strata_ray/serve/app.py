"""`python -m strata_ray.run serve`: the OpenAI-compatible server, a Ray Serve application.

One deployment, `strata`, with a FastAPI ingress; each replica owns one engine (EngineRunner) and answers
every endpoint. Everything the user can get wrong (config, flags, model file) fails before Ray starts, with
one line and exit code 2.
"""

# no `from __future__ import annotations`: FastAPI must see the real `Request` type of the endpoints that
# Serve's ingress rewraps, not a string it would have to resolve.
import asyncio
import contextlib
import hmac
import logging
import os
import time
import uuid
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from strata_ray.config import actor_switches
from strata_ray.run import check_model_file, check_profile_files, fail, say
from strata_ray.serve import openai_api as oa
from strata_ray.serve import status
from strata_ray.serve.runner import EngineRunner, Finished, Piece
from strata_ray.sigterm import interrupt_on_sigterm

APP_NAME = "strata"
SERVE_CONTROLLER, SERVE_NAMESPACE = "SERVE_CONTROLLER_ACTOR", "serve"  # Ray Serve's controller actor
STATIC = Path(__file__).resolve().parent / "static"
LOAD_POLL_S = 0.25
DRAIN_POLL_S = 0.2  # serve_main asks the replicas whether they are idle this often while they drain
DRAIN_FLUSH_S = 0.5  # after the last answer: the HTTP proxy's time to send its last events before Ray stops

api = FastAPI(title="strata-ray", docs_url=None, redoc_url=None, openapi_url=None)


@api.exception_handler(oa.APIError)
async def _api_error(_request: Request, e: oa.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


@api.exception_handler(Exception)
async def _unexpected(_request: Request, e: Exception) -> JSONResponse:
    """A fault of the server's own, still in OpenAI's shape (it was a plain-text 500 clients could not parse);
    the exception's type only (its text may hold the server's paths); Starlette logs the traceback after."""
    message = f"internal error ({type(e).__name__}); the server's log has the details"
    return JSONResponse(oa.APIError(500, message, "server_error").body(), status_code=500)


@api.exception_handler(StarletteHTTPException)
async def _http_error(_request: Request, e: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return JSONResponse(oa.APIError(e.status_code, str(e.detail), kind).body(), status_code=e.status_code)


class ClosingStreamingResponse(StreamingResponse):
    """A streaming response that closes its body generator when the client goes away. Starlette stops
    iterating on a disconnect but leaves the generator suspended until garbage collection; closing it at
    once is what stops the generation and frees the engine for the next request."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def health_state(loaded: bool, load_error: str | None) -> tuple[int, str]:
    """(Above the deployment: the class's methods see only what is defined when it is decorated.) /health's
    (HTTP status, status word): 200 "ok" once the model serves; 503 "loading" before, as
    llama-server answers, so a load balancer or a readiness probe waits; 503 "error" after a failed load."""
    if load_error is not None:
        return 503, "error"
    return (200, "ok") if loaded else (503, "loading")


@serve.deployment(name=APP_NAME, max_ongoing_requests=1000, health_check_period_s=10)
@serve.ingress(api)
class StrataServer:
    def __init__(self, engine_config, api_key: str | None, model_name: str):
        self.metrics = status.ServeMetrics()
        self.runner = EngineRunner(engine_config, self.metrics)
        self.api_key = api_key
        self.model_name = model_name
        self.replica_id = uuid.uuid4().hex  # drain's answers tell the replicas apart

    # --- called by serve_main through the deployment handle -----------------------------------------------

    def load_state(self) -> dict:
        return {"loaded": self.runner.loaded, "error": self.runner.load_error, "info": self.runner.info}

    async def drain(self, grace_s: float) -> dict:
        """serve_main's stop (EngineRunner.drain): new requests get a 503, those taken grace_s seconds. Called
        until every replica has answered idle; this replica's id and whether it still has work."""
        self.runner.drain(grace_s)
        return {"replica": self.replica_id, "busy": self.runner.busy}

    # --- helpers ------------------------------------------------------------------------------------------

    def _auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").strip().partition(" ")
        # the scheme is case-insensitive (RFC 9110 11.1): "bearer KEY" is the same credential
        given = token.strip().encode()
        if scheme.lower() != "bearer" or not hmac.compare_digest(given, self.api_key.encode()):
            raise oa.unauthorized()

    async def _complete(self, job: oa.Completion, endpoint: str):
        runner = self.runner
        with runner.taking():  # a stop's drain waits for it from here (a 503 once the server stops)
            await runner.wait_loaded()
            # off the event loop: a long prompt's tokens take seconds, and every other request waited on them
            ids = await asyncio.to_thread(oa.prompt_ids, job, runner.engine.tokenizer, runner.add_bos,
                                          runner.context)
            room = runner.context - len(ids)
            max_tokens = room if job.max_tokens is None else min(job.max_tokens, room)
            rid = oa.new_id(job.chat)
            rec = self.metrics.enqueue(rid, endpoint)
        # a BOS the server put before a text prompt (oa.encode with the model's add_bos_token): not echoed as
        # text
        added_bos = job.prompt_ids is None and runner.add_bos and runner.engine.tokenizer.bos_id is not None
        events = runner.stream(rec, ids, max_tokens, job.sampling, job.stop, job.engine_logprobs, job.echo,
                               added_bos)
        if job.stream:
            return ClosingStreamingResponse(self._sse(job, rid, events), media_type="text/event-stream",
                                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        pieces: list[Piece] = []
        async with contextlib.aclosing(events):
            async for event in events:
                if isinstance(event, Finished):
                    tokens = [t for piece in pieces for t in piece.tokens]
                    return oa.response(job.chat, rid, self.model_name, "".join(p.text for p in pieces),
                                       event.finish_reason, event.prompt_tokens, event.completion_tokens,
                                       event.timings, self._logprobs(job, tokens), runner.fingerprint)
                pieces.append(event)
        raise oa.server_error("the generation ended without a result")

    def _logprobs(self, job: oa.Completion, tokens) -> dict | None:
        if job.logprobs is None:
            return None
        return oa.logprobs_doc(job.chat, tokens, self.runner.engine.tokenizer.token_bytes, job.logprobs)

    async def _sse(self, job: oa.Completion, rid: str, events):
        model, created = self.model_name, int(time.time())  # one timestamp a stream, as OpenAI's
        fingerprint = self.runner.fingerprint
        same = {"created": created, "usage_slot": job.include_usage, "fingerprint": fingerprint}
        async with contextlib.aclosing(events):
            try:
                first = True
                async for event in events:
                    if first and job.chat:  # the role first, also before an empty answer's finish
                        yield oa.sse(oa.chunk(job.chat, rid, model, role=True, **same))
                    first = False
                    if isinstance(event, Finished):
                        yield oa.sse(oa.chunk(job.chat, rid, model, None, event.finish_reason, **same))
                        if job.include_usage:
                            yield oa.sse(oa.usage_chunk(job.chat, rid, model, event.prompt_tokens,
                                                        event.completion_tokens, created, fingerprint))
                        break
                    yield oa.sse(oa.chunk(job.chat, rid, model, event.text,
                                          logprobs=self._logprobs(job, event.tokens), **same))
            except oa.APIError as e:  # headers are sent: the error travels as an SSE event
                yield oa.sse(e.body())
            yield oa.sse("[DONE]")

    # --- OpenAI endpoints ---------------------------------------------------------------------------------

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        self._auth(request)
        job = oa.parse_chat(oa.parse_json(await request.body()))
        return await self._complete(job, "/v1/chat/completions")

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        self._auth(request)
        job = oa.parse_text(oa.parse_json(await request.body()))
        return await self._complete(job, "/v1/completions")

    @api.post("/tokenize")
    async def tokenize(self, request: Request):
        """The ids a completion would run for a text or a chat, as llama-server and vLLM answer /tokenize."""
        self._auth(request)
        ask = oa.parse_tokenize(oa.parse_json(await request.body()))
        runner = self.runner
        await runner.wait_loaded()
        tokenizer = runner.engine.tokenizer
        ids = await asyncio.to_thread(oa.encode, ask.job, tokenizer, runner.add_bos and ask.add_special)
        return oa.tokenize_doc(ids, tokenizer.token_bytes, ask.with_pieces, runner.context,
                               tokenizer.tokens if ask.token_strs else None)

    @api.post("/detokenize")
    async def detokenize(self, request: Request):
        """Token ids -> text: llama-server's `content` and vLLM's `prompt`."""
        self._auth(request)
        body = oa.parse_json(await request.body())
        await self.runner.wait_loaded()
        tokenizer = self.runner.engine.tokenizer
        text = tokenizer.decode(oa.parse_detokenize(body, tokenizer.n_vocab))
        return {"content": text, "prompt": text}

    @api.get("/v1/models")
    async def models(self, request: Request):
        self._auth(request)
        return oa.models(self.model_name, self.runner.context, int(self.metrics.started))

    @api.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, request: Request):
        """One model's entry (the OpenAI clients' models.retrieve), or a 404 in OpenAI's shape."""
        self._auth(request)
        if model_id != self.model_name:
            raise oa.APIError(404, f"the model {model_id!r} does not exist (this server has "
                              f"{self.model_name!r})", param="model", code="model_not_found")
        return oa.model_entry(self.model_name, self.runner.context, int(self.metrics.started))

    # --- health, status, metrics, page --------------------------------------------------------------------

    @api.api_route("/health", methods=["GET", "HEAD"])
    async def health(self):
        code, state = health_state(self.runner.loaded, self.runner.load_error)
        return JSONResponse({"status": state, "service": "strata", "model": self.model_name,
                             "loaded": self.runner.loaded, "max_context": self.runner.context,
                             "api_key": self.api_key is not None, "error": self.runner.load_error},
                            status_code=code)

    @api.get("/v1/status")
    async def status_(self, request: Request):
        self._auth(request)
        m, r = self.metrics, self.runner
        return {
            "service": "strata",
            "model": self.model_name,
            "loaded": r.loaded,
            "error": r.load_error,
            "engine": r.info,
            "system_fingerprint": r.fingerprint,
            "started": m.started,
            "uptime_s": time.time() - m.started,
            "context": {"native": r.context, "max_positions": r.context},
            "concurrency": {"serving": 1, "queued": m.queued},
            "activity": {"requests": m.totals.requests, "in_flight": m.queued + (m.current is not None),
                         "state": m.state, "last_request_at": m.last_request_at},
            "last_timings": m.last_timings(),
            "tiers": r.tier_totals,
            "machine": status.hardware(r.engine.device if r.engine else "cpu"),
        }

    @api.get("/metrics")
    async def metrics_(self, request: Request):
        self._auth(request)
        doc = self._metrics_doc(request.query_params.get("requests") == "all")
        if request.query_params.get("format") == "prometheus":
            return PlainTextResponse(status.prometheus(doc), media_type="text/plain; version=0.0.4")
        return doc

    def _metrics_doc(self, all_requests: bool) -> dict:
        m, r = self.metrics, self.runner
        return {
            "engine": {"model": self.model_name, "max_context": r.context, **r.info},
            "loaded": r.loaded,
            "uptime_s": time.time() - m.started,
            "live": m.live(),
            "requests": m.requests(all_requests),
            "requests_kept": len(m.recent),
            "totals": vars(m.totals),
            "tiers": r.tier_totals,
            "hardware": status.hardware(r.engine.device if r.engine else "cpu"),
            "time": time.time(),
        }

    @api.get("/")
    async def page(self):
        return HTMLResponse((STATIC / "index.html").read_text(encoding="utf-8"))


# --- serve_main -------------------------------------------------------------------------------------------


def model_name(path: str | None) -> str:
    from strata_ray.config import DEFAULT_MODEL_NAME

    return DEFAULT_MODEL_NAME if path is None else Path(path).name.removesuffix(".gguf")


def check_listen(host: str, port: int) -> None:
    """Bind host:port for a moment, so an address in use (or not this machine's) fails before the model
    loads, with the reason (Ray Serve's own failure comes minutes later and says neither). Only where this run
    started Ray: on an attached cluster Ray Serve's proxy may already listen there, and reusing it is fine."""
    import socket

    from strata_ray.config import ConfigError

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is no clash
            s.bind(address)
    except OSError as e:
        raise ConfigError(f"cannot listen on {host}:{port} ({e.strerror or e})") from None


def serve_main(argv) -> int:
    from dataclasses import replace

    from strata_ray.config import ConfigError
    from strata_ray.engine.engine import check_supported, unavailable_feature
    from strata_ray.experts.profile import ProfileError
    from strata_ray.model.hparams import ModelFormatError
    from strata_ray.serve.config_file import resolve

    try:  # everything the user can get wrong fails here, before Ray starts (the same checks as `run`)
        plan = resolve(argv)
        model_path, hp = check_model_file(plan.engine)
        engine_cfg = check_profile_files(replace(plan.engine, model=model_path), hp)
        if plan.auto_split and unavailable_feature(engine_cfg) == "--layer-split":  # not the user's flag
            gpus = ",".join(str(g) for g in plan.serve.gpu)
            raise ConfigError(f"GPUs {gpus}: the server splits the layers across several GPUs (--layer-split "
                              'auto), which is not available yet; serve on one GPU, or set "layer_split": '
                              '"off" in the config')
        check_supported(engine_cfg)
    except (ConfigError, ModelFormatError, ProfileError) as e:
        return fail(str(e))
    os.environ.update(plan.env)  # CUDA_VISIBLE_DEVICES in PCI bus order, STRATA_* switches
    interrupt_on_sigterm()
    from strata_ray.actors import launch

    session = None
    owns_app = False  # an attached cluster's "strata" application is deleted at the end only if ours
    try:
        session = launch.connect(plan.address, False, plan.verbose)
        # again: Ray's core worker installs its own fatal-signal handler (absl's) as it connects, which
        # printed a C++ stack on SIGTERM and killed the process before the finally below
        interrupt_on_sigterm()
        if session.started:  # our own Ray Serve will listen here; an attached cluster's may already be
            check_listen(plan.serve.host, plan.serve.port)
        else:
            check_serve_free(plan.serve.port)
            owns_app = True
        if not plan.verbose:
            logging.getLogger("ray.serve").setLevel(logging.WARNING)
        auto = engine_cfg.device == "auto"
        engine_cfg = replace(engine_cfg, device=launch.cluster_device(engine_cfg))
        if auto and engine_cfg.device == "cpu" and plan.serve.gpu:  # as cluster_device refuses --device cuda
            # (a note and a CPU server before: the user named GPUs, and a model sized for them on the CPU
            # serves at a small fraction of what they asked for, unnoticed behind the HTTP endpoint)
            gpus = ",".join(map(str, plan.serve.gpu))
            raise ConfigError(f'GPUs {gpus} asked for (--gpu / "gpu"), but the Ray cluster has none: drop '
                              "them to serve on the CPU")
        return _run_server(plan, engine_cfg)
    except KeyboardInterrupt:
        say("stopped")
        return 0
    except Exception as e:  # every failure ends in one line
        message, code = launch.describe_failure(e, "the server")
        return fail(message, code)
    finally:
        if owns_app:  # an attached cluster keeps its other applications, and another server's
            with contextlib.suppress(Exception):
                serve.delete(APP_NAME)
        launch.disconnect(session)


def check_serve_free(port: int) -> None:
    """On an attached cluster: refuse where another server's application already runs there (serve.run
    would replace it under that server, and deleting ours at the end took it away), or where Ray Serve
    already listens on another port (its proxy keeps it: the new port was printed and never served).
    ConfigError, one line. Nothing to check where the cluster runs no Serve yet."""
    import ray

    from strata_ray.config import ConfigError

    try:
        controller = ray.get_actor(SERVE_CONTROLLER, namespace=SERVE_NAMESPACE)
    except ValueError:
        return  # no Ray Serve on this cluster yet: ours starts it
    if APP_NAME in serve.status().applications:
        raise ConfigError(f"a strata server already runs on this Ray cluster (Ray Serve application "
                          f"{APP_NAME!r}); stop it first (one server a cluster), or serve on --address local")
    try:
        listening = ray.get(controller.get_http_config.remote(), timeout=30).port
    except Exception:  # another Ray's controller: let serve.start judge
        return
    if listening != port:
        raise ConfigError(f"Ray Serve already runs on this cluster with its HTTP proxy on port {listening}, "
                          f"which it keeps: serve with --port {listening} (or restart the cluster)")


def placement_problem(replicas: int, gpus_per_replica: int, cluster: dict) -> str | None:
    """Why the replicas can never be placed on a cluster with these total resources (None: they fit).
    Serve would otherwise wait for them forever; each replica takes 1 CPU and its GPUs."""
    have_gpu, have_cpu = int(cluster.get("GPU", 0)), int(cluster.get("CPU", 0))
    need = replicas * gpus_per_replica
    if need > have_gpu:
        return (f"{replicas} replica(s) of {gpus_per_replica} GPU(s) need {need} GPUs; the Ray cluster has "
                f"{have_gpu} (lower --replicas or the config's gpu list)")
    if replicas > have_cpu:
        return (f"{replicas} replica(s) need {replicas} CPUs; the Ray cluster has {have_cpu} "
                "(lower --replicas)")
    return None


def _run_server(plan, engine_cfg) -> int:
    import ray

    cfg = plan.serve
    gpus = max(1, len(cfg.gpu)) if engine_cfg.device == "cuda" else 0
    problem = placement_problem(cfg.replicas, gpus, ray.cluster_resources())
    if problem:
        return fail(problem, 2)
    serve.start(http_options={"host": cfg.host, "port": cfg.port})
    name = model_name(engine_cfg.model)
    # the STRATA_* switches of this process (its shell's, serve.json's env): an attached cluster's replicas
    # run in its raylet's environment, where they were off (launch.launch gives run's actors the same)
    switches = actor_switches(os.environ)
    options = {"num_cpus": 1, "num_gpus": gpus}
    if switches:
        options["runtime_env"] = {"env_vars": switches}
    app = StrataServer.options(num_replicas=cfg.replicas, ray_actor_options=options).bind(
        engine_cfg, cfg.api_key, name)
    started = time.monotonic()  # the replica loads the model from its construction, inside serve.run
    try:
        handle = serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        return _serve(handle, cfg, name, started)
    except KeyboardInterrupt:  # told to stop: the requests taken finish first (a second Ctrl-C: at once).
        # Also before the "loaded" line, and inside serve.run: a replica serves from its load on, and
        # serve.run may still wait for the application's status then (a CI run's stop landed there)
        try:
            handle = serve.get_app_handle(APP_NAME)
        except Exception:  # no application yet: nothing taken
            raise KeyboardInterrupt from None
        drain_replicas(handle, cfg.replicas, cfg.shutdown_grace)
        raise


def _serve(handle, cfg, name: str, started: float) -> int:
    """Wait for the model, say where it serves, then serve until interrupted."""
    while True:
        state = handle.load_state.remote().result()
        if state["error"]:
            return fail(f"the model failed to load: {state['error']}", 1)
        if state["loaded"]:
            break
        time.sleep(LOAD_POLL_S)
    info = state["info"]
    host = "127.0.0.1" if cfg.host in ("0.0.0.0", "::") else cfg.host
    say(f"loaded {name} ({info.get('arch')}, {info.get('n_layer')} layers, {info.get('n_expert')} experts) "
        f"on {info.get('device')} in {time.monotonic() - started:.1f} s")
    say(f"serving on http://{host}:{cfg.port} (OpenAI API at /v1, chat and monitor at /; Ctrl-C stops)")
    while True:
        time.sleep(3600)


def drain_replicas(handle, replicas: int, grace_s: float) -> None:
    """Tell every replica to stop taking requests and wait until each says it is idle, or its grace is over
    (then it ends what still runs with a 503 of its own): a stream open at Ctrl-C was cut mid-token, with no
    error and no [DONE]. A handle call reaches one replica of the router's choice, so it is repeated until
    `replicas` distinct ones answered idle; drain keeps its first deadline. At most the grace + 1 s."""
    deadline = time.monotonic() + grace_s + 1.0
    busy: dict[str, bool] = {}
    said = False
    while time.monotonic() < deadline:
        try:
            state = handle.drain.remote(grace_s).result(timeout_s=max(0.1, deadline - time.monotonic()))
        except Exception:  # a replica gone or slow to answer: the deadline still bounds the stop
            time.sleep(DRAIN_POLL_S)
            continue
        busy[state["replica"]] = state["busy"]
        if len(busy) >= replicas and not any(busy.values()):
            break
        if state["busy"] and not said:
            said = True
            say(f"stopping: the requests taken get up to {grace_s:g} s to finish (Ctrl-C again stops now)")
        time.sleep(DRAIN_POLL_S if len(busy) >= replicas else 0.01)  # the router spreads calls on
    time.sleep(DRAIN_FLUSH_S)

