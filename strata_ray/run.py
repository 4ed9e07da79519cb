"""`python -m strata_ray.run`: the command line; subcommands generate (default), serve, bench, profile, synth.

generate: check the model file here (fast, before Ray), attach to a Ray cluster or start a local one, place
the coordinator and the primary, load the model there, stream the generated text to stdout. Every user error
ends with one line on stderr and exit code 2; an engine failure with one line naming the actor and exit 1.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace

from strata_ray.capped_read import MIB, TooLong, read_capped
from strata_ray.config import (
    ConfigError,
    build_arg_parser,
    check_peer_device_visible,
    check_save_path,
    config_from_args,
    decimal,
    float_range,
    int_range,
    parse_value,
    seed_value,
)
from strata_ray.engine.progress import terminal_bars

PROG = "python -m strata_ray.run"
DEFAULT_PROMPT = "The Python standard library"
PROMPT_LIMIT = 64 * MIB  # characters (bytes on stdin): far past any model's context, short of a host's memory
# subcommand -> (module, function); each takes argv and returns an exit code
DELEGATED = {
    "serve": ("strata_ray.serve.app", "serve_main"),
    "bench": ("strata_ray.bench.cli", "bench_main"),
    "profile": ("strata_ray.experts.profile_cli", "profile_main"),
    "synth": ("strata_ray.model.synth", "synth_main"),
}
SUBCOMMANDS = ("generate", *DELEGATED)


def fail(message: str, code: int = 2) -> int:
    sys.stderr.write(f"strata_ray: {message}\n")
    sys.stderr.flush()
    return code


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    named = bool(argv) and argv[0] in SUBCOMMANDS
    command, rest = (argv[0], argv[1:]) if named else ("generate", argv)
    if rest and not named and not rest[0].startswith("-"):  # `run serv`: not a prompt either
        return fail(f"unknown command {argv[0]!r} (commands: {', '.join(SUBCOMMANDS)}; a prompt goes in "
                    "--prompt, --prompt-file or stdin)")
    if command == "generate":
        return generate_main(rest)
    from strata_ray.actors.launch import prepare_token_auth

    # before the command's module imports Ray (serve's does at once): Ray reads the auth mode as it loads,
    # and `serve --address HOST:PORT` failed on a token cluster where `run` attached
    prepare_token_auth(address_in(rest))
    entry = _delegate(command)
    if entry is None:
        return fail(f"the {command} command is not available yet")
    return int(entry(rest) or 0)


def address_in(argv: Sequence[str]) -> str | None:
    """The value of the last --address in argv (`--address X` or `--address=X`), or None."""
    found = None
    for i, arg in enumerate(argv):
        if arg == "--address" and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith("--address="):
            found = arg.split("=", 1)[1]
    return found


def _delegate(command: str) -> Callable[[list[str]], int] | None:
    module_name, function = DELEGATED[command]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):  # the command's own module is absent, not a dependency
            return None
        raise
    return getattr(module, function, None)


def build_generate_parser():
    parser = build_arg_parser(PROG)
    parser.description += (
        f"\n\nsubcommands: {', '.join(SUBCOMMANDS)} (default generate); `{PROG} COMMAND --help` for each."
    )
    prompt = parser.add_argument_group("prompt", "default: stdin if not a terminal, else a sample prompt")
    source = prompt.add_mutually_exclusive_group()
    source.add_argument("--prompt", "-p", metavar="TEXT", help="prompt text")
    source.add_argument("--prompt-file", "-f", metavar="FILE", help="read the prompt from FILE")
    source.add_argument("--prompt-ids", metavar="1,2,3", help="prompt as token ids, used as given (no BOS)")
    prompt.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")

    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", "-n", metavar="N", default="256", help="tokens to generate (256)")
    sampling.add_argument("--temperature", metavar="T", default="0",
                          help="0 = greedy (default; below 1e-5 greedy too)")
    sampling.add_argument("--top-k", metavar="K", default="0", help="keep the K most likely tokens (0 = off)")
    sampling.add_argument("--top-p", metavar="P", default="1",
                          help="nucleus sampling mass, 0 to 1 (1 = off; 0: the most likely token)")
    sampling.add_argument("--min-p", metavar="P", default="0", help="drop tokens below P x top (0 = off)")
    sampling.add_argument("--seed", metavar="S", default=None, help="random seed for sampling")

    output = parser.add_argument_group("output")
    output.add_argument("--json", action="store_true",
                        help="print one JSON object (token_ids, text, prompt_tokens, generated_tokens, "
                             "finish_reason, timings; experts on a tiered run, logprobs and token_logprobs "
                             "with --logprobs, warnings when there are some), no text")
    output.add_argument("--logprobs", metavar="K", default="0",
                        help="with --json: top-K logprobs per token and the chosen token's own (of the "
                             "model's distribution, before temperature and the top-k/top-p/min-p filters); "
                             "K from 1 to 20, 0 (the default) for none")

    ray_group = parser.add_argument_group("ray")
    ray_group.add_argument("--address", metavar="auto|local|HOST:PORT", default=None,
                           help="Ray cluster to attach to (default: RAY_ADDRESS, else a running cluster, "
                           "else a new local instance; 'local' always starts a local instance)")
    ray_group.add_argument("--dashboard", action="store_true",
                           help="include the Ray dashboard when starting a local instance")
    ray_group.add_argument("--keep-actors", action="store_true",
                           help="leave strata:primary and strata:coordinator running on an attached cluster "
                           "(the next run with the same flags reuses them)")
    ray_group.add_argument("--replace-actors", action="store_true",
                           help="remove kept engine actors whose flags differ from this run's")
    ray_group.add_argument("--verbose", "-v", action="store_true", help="show Ray's and the actors' logs")
    return parser


def request_values(ns, n_vocab: int) -> dict:
    """Checked values of the generation flags, without torch (a bad flag fails fast) and before the prompt
    is read from a file or stdin."""
    sampling = dict(
        temperature=parse_value(float_range(0.0, 100.0), ns.temperature, "--temperature"),
        top_k=parse_value(int_range(0), ns.top_k, "--top-k"),
        top_p=parse_value(float_range(0.0, 1.0), ns.top_p, "--top-p"),
        min_p=parse_value(float_range(0.0, 1.0), ns.min_p, "--min-p"),
        seed=None if ns.seed is None else parse_value(seed_value, ns.seed, "--seed"),
    )
    common = dict(
        max_tokens=parse_value(int_range(1), ns.max_tokens, "--max-tokens"),
        logprobs=parse_value(int_range(0, 20), ns.logprobs, "--logprobs"),
    )
    if common["logprobs"] and not ns.json:
        raise ConfigError("--logprobs needs --json (the log-probabilities are printed in the JSON object)")
    if ns.prompt_ids is not None:
        if ns.chat:
            raise ConfigError("--chat cannot be combined with --prompt-ids (token ids are used as given)")
        ids = parse_value(_token_ids, ns.prompt_ids, "--prompt-ids")
        bad = next((i for i in ids if i >= n_vocab), None)
        if bad is not None:
            raise ConfigError(f"--prompt-ids: token id {bad} is out of range (vocabulary of {n_vocab})")
        common["prompt_ids"] = ids
    return {"sampling": sampling, **common}


def build_request(ns, values: dict):
    """The GenerationRequest; prompt text is read here (tokenized in the primary)."""
    from strata_ray.engine.engine import GenerationRequest
    from strata_ray.engine.sampling import SamplingParams

    values = dict(values, sampling=SamplingParams(**values["sampling"]))
    if "prompt_ids" not in values:
        values.update(prompt=read_prompt(ns), chat=ns.chat)
        if values["prompt"] == "" and not ns.chat:  # the primary would refuse it, after Ray and the load
            raise ConfigError("the prompt is empty")
    return GenerationRequest(**values)


def check_prompt_fits(request, model: str | None, context: int) -> None:
    """A prompt that leaves no room in the model's context is refused here, in one line, before Ray starts:
    the primary refused it only after the model's load (minutes for a large one). Ids count as given; a
    text is tokenized as the primary will (text_prompt_ids), unless it fits whatever its tokens (a
    byte-level vocabulary spells each byte with one token at most, NFC makes a UTF-8 text at most 3x longer,
    and a BOS is one more; the chat template's own text is not known before it is applied): a short prompt
    costs no tokenizer build (~0.6 s at a 152K vocabulary)."""
    from strata_ray.engine.context_room import prompt_fits, too_long
    from strata_ray.engine.engine import text_prompt_ids
    from strata_ray.model.gguf_file import GGUFFile
    from strata_ray.model.loader import resolve_model_path
    from strata_ray.model.tokenizer import ChatTemplateError, Tokenizer

    if request.prompt_ids is not None:
        count = len(request.prompt_ids)
    else:
        if not request.chat and 3 * len(request.prompt.encode("utf-8")) + 1 < context:
            return
        file = GGUFFile(resolve_model_path(model))
        tokenizer = Tokenizer.from_gguf(file)
        least = tokenizer.fewest_tokens(request.prompt)  # a huge text refused unread, as serve refuses it
        if not prompt_fits(least, context, request.max_tokens):
            raise ConfigError(too_long(f"at least {least}", context))
        try:
            count = len(text_prompt_ids(tokenizer, file.fields, request.prompt, request.chat))
        except ChatTemplateError as e:  # the primary's one line, sooner
            raise ConfigError(str(e).splitlines()[0]) from None
    if not prompt_fits(count, context, request.max_tokens):
        raise ConfigError(too_long(count, context))


def read_prompt(ns) -> str:
    if ns.prompt is not None:
        try:  # argv bytes that are not UTF-8 arrive as lone surrogates (os.fsdecode); they ended the run
            ns.prompt.encode("utf-8")  # after the load, "UnicodeEncodeError" and exit 1
        except UnicodeEncodeError:
            raise ConfigError("--prompt is not UTF-8 text") from None
        return ns.prompt
    if ns.prompt_file is not None:
        try:
            with open(ns.prompt_file, encoding="utf-8") as f:
                return read_capped(f, PROMPT_LIMIT)
        except OSError as e:
            raise ConfigError(f"--prompt-file: cannot read {ns.prompt_file} ({e.strerror})") from None
        except UnicodeDecodeError:
            raise ConfigError(f"--prompt-file: {ns.prompt_file} is not UTF-8 text") from None
        except TooLong as e:
            raise ConfigError(f"--prompt-file: {ns.prompt_file} is {e}; a prompt is text") from None
    if sys.stdin is not None and not sys.stdin.isatty():
        try:
            stdin = getattr(sys.stdin, "buffer", None)  # bytes, so a bad encoding is ours to report
            text = read_capped(stdin, PROMPT_LIMIT).decode("utf-8") if stdin is not None else read_capped(
                sys.stdin, PROMPT_LIMIT)
        except UnicodeDecodeError:
            raise ConfigError("the prompt on stdin is not UTF-8 text") from None
        except TooLong as e:
            raise ConfigError(f"the prompt on stdin is {e}; a prompt is text") from None
        if text:
            return text
    say(f"no prompt given (--prompt, --prompt-file or stdin); using {DEFAULT_PROMPT!r}")
    return DEFAULT_PROMPT


def _token_ids(s: str) -> tuple[int, ...]:
    try:
        ids = tuple(decimal(x.strip()) for x in s.split(","))  # "1, 2" as "1,2"
    except ValueError:
        raise ValueError("comma-separated token ids >= 0, e.g. 1,2,3") from None
    if any(i < 0 for i in ids):
        raise ValueError("comma-separated token ids >= 0, e.g. 1,2,3")
    return ids


def check_peer_visible_here(cfg) -> None:
    """Refusal 4, checked where the peer's GPU must be: this machine, when the cluster is a local one."""
    if cfg.peer_active:
        import torch

        check_peer_device_visible(cfg, torch.cuda.device_count())


def check_model_file(cfg):
    """Open the GGUF in the driver so a bad file fails in a second, before any Ray work. Returns the
    absolute path (None = the embedded default, resolved again where the primary runs) and the HParams."""
    from strata_ray.experts.host_store import experts_block_quantized
    from strata_ray.model.gguf_file import GGUFFile
    from strata_ray.model.loader import resolve_model_path

    file = GGUFFile(resolve_model_path(cfg.model))
    hp = file.hparams  # ModelFormatError with the one-line reason
    file.check_model()  # missing / misshapen tensors, unsupported types, no tokenizer: from the header
    given = (("--expert-cache", cfg.expert_cache), ("--vram-budget-mib", cfg.vram_budget_mib),
             ("--expert-profile", cfg.expert_profile), ("--expert-profile-save", cfg.expert_profile_save))
    unused = [flag for flag, value in given if value is not None]
    if unused and not experts_block_quantized(file):
        say(f"{os.path.basename(file.path)}: its routed experts are not all Q8_0 / Q4_0 / Q4_K / Q6_K, so "
            f"they load with the dense weights and have no tiers: {', '.join(unused)} "
            + ("has" if len(unused) == 1 else "have") + " no effect")
    return (None if cfg.model is None else os.path.abspath(cfg.model)), hp


def model_routing_digest(model: str | None) -> bytes:
    """The routing identity (model/routing_digest) of the GGUF at `model` (None: the embedded default)."""
    from strata_ray.model.gguf_file import GGUFFile
    from strata_ray.model.loader import resolve_model_path
    from strata_ray.model.routing_digest import routing_digest

    return routing_digest(GGUFFile(resolve_model_path(model)))


def check_profile_files(cfg, hp):
    """--expert-profile must be an STRP for this model's shape, --expert-profile-save a file path in a folder
    we can write; both become absolute (the primary's working directory is not ours). Returns cfg.

    A learned profile already at --expert-profile-save fills the cache instead of --expert-profile (as the
    reference engine does: a restart resumes from what the last start learned), when it fits this model;
    one line says so. One that does not fit is left to be overwritten (one line), unless --expert-profile
    names the same file, which is then refused. The same path for both where nothing is saved yet: the
    first start fills the cache in the default order (one line) instead of refusing a missing file. A
    profile made on another model of this shape (its routers' digest, where the file names one) is told in
    one line: --expert-profile's still fills the cache (the output does not depend on it), a learned one at
    --expert-profile-save does not (it is overwritten), unless both flags name it."""
    from strata_ray.experts.profile import MAGIC, ProfileError, check_shape, model_mismatch, read_profile

    fill = None if cfg.expert_profile is None else os.path.abspath(cfg.expert_profile)
    save = None if cfg.expert_profile_save is None else os.path.abspath(cfg.expert_profile_save)
    resume = cfg.resumes_profile
    digest = None if fill is None and save is None else model_routing_digest(cfg.model)
    fills_anyway = ("; its ranking fills the cache all the same (the output is the same whatever the cache "
                    "holds; only its hits suffer)")
    if fill is not None and not resume:
        profile = read_profile(fill)
        check_shape(profile, hp)  # ProfileError: the one line (a bad flag, even if unused)
        if note := model_mismatch(profile, digest):
            say(f"--expert-profile: {note}{fills_anyway}")
    if save is not None:
        # never over the model or a file that is not a profile (an STRP of another shape is overwritten)
        check_save_path(save, "--expert-profile-save", {"--model": cfg.model}, MAGIC, "an STRP profile")
        if os.path.exists(save):
            try:
                saved = read_profile(save)
                check_shape(saved, hp)
                note = model_mismatch(saved, digest)
                if note and not resume:  # another model's learning: --expert-profile (or none) fills
                    raise ProfileError(note)
            except ProfileError as e:
                if resume:
                    raise
                say(f"--expert-profile-save: {e}; not used to fill the cache (it is overwritten)")
            else:
                if note:
                    say(f"--expert-profile: {note}{fills_anyway}")
                if not resume:
                    instead = "" if fill is None else f" instead of --expert-profile {cfg.expert_profile}"
                    say(f"--expert-profile-save {cfg.expert_profile_save}: the expert cache fills from the "
                        f"profile an earlier start learned there{instead}")
                return replace(cfg, expert_profile=save, expert_profile_save=save)
        elif resume:
            say(f"--expert-profile {cfg.expert_profile}: nothing saved there yet; the expert cache fills in "
                "the default order and the learned profile is saved there")
            return replace(cfg, expert_profile=None, expert_profile_save=save)
    return replace(cfg, expert_profile=fill, expert_profile_save=save)


def generate_main(argv: Sequence[str]) -> int:
    from strata_ray.experts.profile import ProfileError
    from strata_ray.model.hparams import ModelFormatError

    try:  # everything the user can get wrong fails here, in a second, before Ray starts
        ns = build_generate_parser().parse_args(list(argv))
        from strata_ray.actors.launch import check_address

        check_address(ns.address)  # launch.connect's check, before the prompt's note and the model's checks
        cfg = config_from_args(ns, os.environ)
        model_path, hp = check_model_file(cfg)
        cfg = check_profile_files(replace(cfg, model=model_path), hp)
        values = request_values(ns, hp.n_vocab)
        if ns.address == "local":
            check_peer_visible_here(cfg)
        from strata_ray.engine.engine import check_supported

        check_supported(cfg)
        request = build_request(ns, values)
        check_prompt_fits(request, cfg.model, hp.context_length)
    except (ConfigError, ModelFormatError, ProfileError) as e:
        return fail(str(e))
    from strata_ray.actors import launch
    from strata_ray.sigterm import interrupt_on_sigterm

    session = dep = actor = None
    keep = False
    owner = uuid.uuid4().hex  # this run's generation, for a kept primary's stop
    interrupt_on_sigterm()  # systemd, docker, `timeout`: as a Ctrl-C, not Ray's C++ stack and exit 15
    try:
        session = launch.connect(ns.address, ns.dashboard, ns.verbose)
        interrupt_on_sigterm()  # again: Ray's core worker installed its own as it connected
        say(_session_line(session, ns.dashboard))
        cfg = replace(cfg, device=launch.cluster_device(cfg))
        if session.started:
            check_peer_visible_here(cfg)
        keep = ns.keep_actors and not session.started
        if ns.keep_actors and session.started:
            say("--keep-actors: a local Ray instance ends with this run (attach to `ray start --head`)")
        actor = launch.COORDINATOR_NAME
        dep = None if session.started else launch.find_existing(cfg, replace=ns.replace_actors)
        actor = None
        if dep is not None:
            say(f"reusing {launch.PRIMARY_NAME} and {launch.COORDINATOR_NAME} kept by an earlier run")
        else:
            dep = launch.launch(cfg, keep=keep)
        actor = launch.PRIMARY_NAME
        keep_asked, keep = keep, False  # actors whose model failed to load are never kept
        load_model_remote(dep, reused=not dep.created, verbose=ns.verbose)
        keep = keep_asked
        try:
            summary = stream_generation(dep, request, as_json=ns.json, owner=owner)
        except BrokenPipeError:  # stdout's reader went away (`run ... | head`): a quiet end, as a shell tool
            dep.primary.stop.remote(owner)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's exit flush would raise
            return 141  # 128 + SIGPIPE
        say(summary.summary_line())
        if summary.seed is not None and request.sampling.seed is None:  # else the run could not be repeated
            say(f"sampled with seed {summary.seed}; --seed {summary.seed} draws the same tokens")
        for line in summary.warnings:  # after the text and the summary: nothing generated is lost
            say(line)
        return 1 if summary.warnings else 0
    except KeyboardInterrupt:
        if dep is not None and not dep.created:
            dep.primary.stop.remote(owner)  # kept actors live on: end only our generation, not another run's
        if sys.stdout.isatty():
            sys.stdout.write("\n")  # end the half-printed line before the message
        sys.stdout.flush()
        return fail("interrupted", 130)
    except Exception as e:  # every failure ends in one line
        launch.exit_if_cluster_gone(session, e, lambda line: fail(line, 1))  # not the actor's fault
        message, code = launch.describe_failure(e, actor)
        return fail(message, code)
    finally:
        launch.teardown(dep, keep, session)
        launch.disconnect(session)


def say(line: str) -> None:
    sys.stderr.write(f"strata_ray: {line}\n")
    sys.stderr.flush()


def _session_line(session, dashboard: bool) -> str:
    if not session.started:
        line = f"attached to the running Ray cluster at {session.address}"
        if not dashboard:
            return line
        if session.dashboard_url:  # --dashboard starts none on a cluster: it names the cluster's own
            return f"{line} (its dashboard at {session.dashboard_url})"
        return f"{line} (--dashboard: the cluster runs no dashboard; `ray start --head` starts one)"
    if not dashboard:
        board = "no dashboard"
    elif session.dashboard_url:  # the one place the URL is told without -v (Ray's own line is INFO)
        board = f"with the dashboard at {session.dashboard_url}"
    else:
        board = "the dashboard asked for did not start (-v shows Ray's log)"
    return (f"started a local Ray instance ({board}; `ray start --head` beforehand to attach to a "
            "cluster instead)")


def load_model_remote(dep, reused: bool, verbose: bool = False) -> dict:
    """Load the model in the primary. On a terminal, progress bars (load stage, cache fill) drawn from the
    primary's load_progress(), polled through its second concurrency slot. Then the load line and the
    cache's fill line (with --verbose that one already comes through Ray's log forwarding)."""
    import ray

    started = time.monotonic()
    ref = dep.primary.load.remote()
    bars = terminal_bars(sys.stderr)
    if bars is not None:
        try:
            asked = None  # one load_progress() call in flight; the bars keep ticking while it waits
            while not ray.wait([ref], timeout=0.2)[0]:
                asked = asked or dep.primary.load_progress.remote()
                if ray.wait([asked], timeout=0)[0]:
                    bars.update(ray.get(asked))
                    asked = None
                else:
                    bars.refresh()
            bars.update(ray.get(dep.primary.load_progress.remote()))  # the final state: a full fill bar
        except ray.exceptions.RayError:
            pass  # the primary failed: ray.get(ref) below says how
        finally:
            bars.close()
    info = ray.get(ref)
    layers = f"{info['n_layer']} layer{'s' if info['n_layer'] != 1 else ''}"
    what = (f"{os.path.basename(info['path'])} ({info['arch']}, {layers}, "
            f"{info['n_expert']} experts) on {info['device']}")
    say(f"model already loaded: {what}" if reused else f"loaded {what} in {time.monotonic() - started:.1f} s")
    if info.get("expert_cache") and not reused and not verbose:
        say(info["expert_cache"])
    if info.get("pin_error") and not reused:
        say(f"host store: {info['pin_error']}; the other expert layers stay unpinned (slower copies)")
    return info


def stream_generation(dep, request, as_json: bool, owner: str | None = None):
    """Print text batches as the primary yields them; returns the GenerationSummary. owner: this run's id,
    which its stop names."""
    import ray

    from strata_ray.engine.engine import GenerationSummary, TokenBatch

    out = sys.stdout
    summary = None
    # the coordinator's rounds so far: kept actors have served other runs, and this one reports its own
    rounds_before = ray.get(dep.coordinator.status.remote()).get("adaptive") if as_json else None
    for ref in dep.primary.generate_stream.options(num_returns="streaming").remote(request, owner):
        item = ray.get(ref)
        if isinstance(item, TokenBatch):
            if not as_json and item.text:
                out.write(item.text)
                out.flush()
        elif isinstance(item, GenerationSummary):
            summary = item
    if summary is None:
        raise RuntimeError("the primary ended the stream without a summary")
    if as_json:
        adaptive = None
        if summary.expert_stats is not None:  # the rounds the coordinator planned (CoordinatorRounds)
            adaptive = counts_since(ray.get(dep.coordinator.status.remote()).get("adaptive"), rounds_before)
        out.write(json.dumps(summary_json(summary, adaptive), ensure_ascii=False) + "\n")
    elif out.isatty() and not summary.text.endswith("\n"):
        out.write("\n")
    out.flush()
    return summary


def counts_since(now: dict | None, before: dict | None) -> dict | None:
    """A dict of counts less an earlier copy of it (keys the earlier one lacks count from 0)."""
    if now is None or before is None:
        return now
    return {key: value - before.get(key, 0) for key, value in now.items()}


def summary_json(s, adaptive: dict | None = None) -> dict:
    """The --json object. `experts` (tiered models): the tiers' counters of this run (hit rate per tier,
    CPU entries, swaps, host ms per token; kept actors' earlier runs are not in them) and, under
    `coordinator`, the adaptive rounds it planned for this run."""
    doc = {
        "token_ids": list(s.token_ids),
        "text": s.text,
        "prompt_tokens": s.prompt_tokens,
        "generated_tokens": len(s.token_ids),
        "finish_reason": s.finish_reason,
        "seed": s.seed,
        "timings": {
            "prompt_seconds": s.prompt_seconds,
            "decode_seconds": s.decode_seconds,
            "prompt_tokens_per_second": s.prompt_tokens_per_second,
            "decode_tokens_per_second": s.decode_tokens_per_second,
        },
    }
    if s.expert_stats is not None:
        doc["experts"] = {**s.expert_stats, **({"coordinator": adaptive} if adaptive is not None else {})}
    if s.top_logprobs is not None:
        doc["logprobs"] = [_top_entries(t) for t in s.top_logprobs]
    if s.token_logprobs is not None:  # the chosen token's own, also where a draw left the top K
        doc["token_logprobs"] = [float(lp) for lp in s.token_logprobs]
    if s.warnings:
        doc["warnings"] = list(s.warnings)
    return doc


def _top_entries(top) -> list[dict]:
    """One generated token's top-K as [{"token_id", "logprob"}], best first, from a dict or (id, lp) pairs."""
    pairs = top.items() if isinstance(top, dict) else top
    return [{"token_id": int(i), "logprob": float(lp)} for i, lp in pairs]


def _exit_quietly_on_ctrl_c() -> None:
    """From here on a Ctrl-C ends the process as SIGINT does (exit status 130), with no traceback: the
    command's work and its one line are done, and a KeyboardInterrupt raised in Ray's exit hooks printed
    one."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.SIG_DFL)


def cli() -> None:
    """`python -m strata_ray.run` and the installed `strata-ray` command: main, then its exit status."""
    code = main()
    _exit_quietly_on_ctrl_c()
    sys.exit(code)


if __name__ == "__main__":
    cli()
