"""`python -m strata_ray.run bench`: flashbench (prefill/decode tables) and the exactness gates.

    bench [--quick] [--contexts 8k,32k,128k] [--repeats 3] [--json-out r.json] [--plot r.png]
    bench gate --save ref.json | --against ref.json
    bench longgate --save ref.json | --against ref.json
each with the engine flags of `run`, and `--local` (the Engine in this process) or `--url URL` (any
OpenAI-compatible server) instead of the default Ray actors. Exit codes: 0 done / gate passed, 1 gate
failed or engine failure, 2 a user error (one line).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace

from strata_ray.bench import gate, measure, report
from strata_ray.bench.prompts import PromptBuilder, PromptError, parse_token_count
from strata_ray.bench.targets import open_target, say
from strata_ray.config import (
    ConfigError,
    build_arg_parser,
    check_save_path,
    config_from_args,
    float_range,
    int_range,
    parse_value,
    seed_value,
)

PROG = "python -m strata_ray.run bench"
DEFAULT_CONTEXTS = "8k,32k,128k"
QUICK_CONTEXTS = "1k,32k"
GATE_GEN_TOKENS = 256


def build_parser(command: str):
    prog = PROG if command == "run" else f"{PROG} {command}"
    if command == "run":
        description = ("flashbench: prefill tok/s at each context, decode tok/s after a prompt of that "
                       "depth, and a 3,000-token story; medians of --repeats. Subcommands: gate, longgate.")
    else:
        size = ("three prompts (chat, code of ~4K tokens, math)" if command == "gate"
                else "one ~20K-token prompt")
        description = (f"exactness gate: {size}, greedy unless --temperature says otherwise (a seeded draw "
                       "is exact too), output token ids compared exactly; prints GATE: PASS or GATE: FAIL "
                       "and exits 1 on a failure")
    parser = build_arg_parser(prog, description, error_prefix="strata_ray bench")  # as fail() writes
    target = parser.add_argument_group("target (default: the engine's Ray actors, as `run` uses them)")
    where = target.add_mutually_exclusive_group()
    where.add_argument("--local", action="store_true", help="run the Engine in this process, without Ray")
    where.add_argument("--url", metavar="URL", help="drive an OpenAI-compatible server (e.g. "
                       "http://host:8000); the results are named as its /v1/models names its model, and "
                       "--model then only supplies its tokenizer for exact prompt lengths (a file of "
                       "another name gets a note; without it the server's /tokenize counts them where it has "
                       "one, else they are estimated)")
    target.add_argument("--api", choices=("chat", "completions"), default=None,
                        help="with --url: /v1/chat/completions (default) or /v1/completions")
    target.add_argument("--served-model", metavar="NAME", help="with --url: the model name to request "
                        "(default: the first one /v1/models lists)")
    target.add_argument("--api-key", metavar="KEY", help="with --url: sent as 'Authorization: Bearer KEY' "
                        "(default: $OPENAI_API_KEY)")
    target.add_argument("--address", metavar="auto|local|HOST:PORT", help="Ray cluster to attach to (as run)")
    target.add_argument("--replace-actors", action="store_true",
                        help="remove engine actors kept by an earlier run with other flags (as run)")
    target.add_argument("--verbose", "-v", action="store_true", help="show Ray's and the actors' logs")

    sampling = parser.add_argument_group("sampling (default greedy)")
    sampling.add_argument("--temperature", metavar="T", default=None, help="0 = greedy (default)")
    sampling.add_argument("--top-k", metavar="K", default=None, help="keep the K most likely tokens (0 off)")
    sampling.add_argument("--top-p", metavar="P", default=None, help="nucleus sampling mass (1 = off)")
    sampling.add_argument("--min-p", metavar="P", default=None,
                          help="drop tokens below P x the most likely one's probability (0 = off)")
    sampling.add_argument("--seed", metavar="S", default=None, help="random seed for sampling")

    if command == "run":
        bench = parser.add_argument_group("benchmark")
        bench.add_argument("--quick", action="store_true",
                           help=f"contexts {QUICK_CONTEXTS} and one repeat (unless --contexts/--repeats)")
        bench.add_argument("--contexts", metavar="N[,N..]",
                           help=f"prompt depths in tokens, k = 1024 (default {DEFAULT_CONTEXTS}); each at "
                           "least the prompt's fixed text (the chat template and the task's words: ~70 "
                           "tokens with the embedded model's tokenizer; refused once the tokenizer is read)")
        bench.add_argument("--repeats", metavar="N", help="runs per measurement; medians are reported (3)")
        bench.add_argument("--gen", metavar="N", default="256",
                           help="tokens generated after each context prompt (decode at that depth; 256)")
        bench.add_argument("--story-tokens", metavar="N", default="3000",
                           help="length of the story run, decode tok/s from a short prompt (3000; 0 = skip)")
        bench.add_argument("--no-warmup", action="store_true",
                           help="skip the untimed warm-up (the story prompt, then one of the smallest "
                                "context, a few tokens each)")
        bench.add_argument("--json-out", metavar="PATH", help="write the full report as JSON")
        bench.add_argument("--plot", metavar="PNG",
                           help="draw prefill and decode against context (needs matplotlib)")
    else:
        g = parser.add_argument_group("gate")
        mode = g.add_mutually_exclusive_group(required=True)
        mode.add_argument("--save", metavar="REF.json", help="run the gate prompts and save the outputs")
        mode.add_argument("--against", metavar="REF.json", help="run the saved prompts, compare token ids")
        g.add_argument("--max-tokens", "-n", metavar="N", default=None,
                       help=f"tokens per prompt with --save ({GATE_GEN_TOKENS}); "
                       "--against uses the reference's")
    return parser


def parse_sampling(ns, saved: dict | None = None):
    """SamplingParams from the flags; a flag not given takes the reference's value (gate --against)."""
    from strata_ray.engine.sampling import SamplingParams

    saved = saved or {}

    def pick(flag_value, key, parse, label, default):
        if flag_value is not None:
            return parse_value(parse, flag_value, label)
        return saved.get(key, default)

    return SamplingParams(
        temperature=pick(ns.temperature, "temperature", float_range(0.0, 100.0), "--temperature", 0.0),
        top_k=pick(ns.top_k, "top_k", int_range(0), "--top-k", 0),
        top_p=pick(ns.top_p, "top_p", float_range(0.0, 1.0), "--top-p", 1.0),
        min_p=pick(ns.min_p, "min_p", float_range(0.0, 1.0), "--min-p", 0.0),
        seed=pick(ns.seed, "seed", seed_value, "--seed", None),
    )


def reference_sampling(ns, doc: dict):
    """gate --against: parse_sampling over the reference's saved sampling, whose bad value names the file."""
    from strata_ray.engine.sampling import SamplingError

    try:
        sampling = parse_sampling(ns, doc.get("sampling"))
    except SamplingError as e:
        raise gate.GateFileError(f"--against: {ns.against} is not a valid gate reference (sampling: {e}); "
                                 "make one with --save") from None
    saved = gate.sampling_record(parse_sampling(_no_flags(ns), doc.get("sampling")))
    for key, value in gate.sampling_record(sampling).items():
        if key != "temperature" and sampling.temperature == saved["temperature"] == 0:
            continue  # greedy: the seed and the filters change nothing
        if value != saved[key]:  # a flag that changes the reference's sampling: tokens that cannot match
            flag = "--" + key.replace("_", "-")
            was = "none" if saved[key] is None else saved[key]
            raise ConfigError(f"{flag} {value} differs from the reference's {was}: --against runs the "
                              "reference's sampling (drop the flag)")
    return sampling


def _no_flags(ns):
    """ns with no sampling flag given (the reference's own values)."""
    from argparse import Namespace

    return Namespace(**{**vars(ns), "temperature": None, "top_k": None, "top_p": None, "min_p": None,
                        "seed": None})


def check_url(url: str) -> None:
    """--url: http(s)://HOST[:PORT][/PATH], or one line (ConfigError) before anything is sent."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (a port that is not a number raises here)
    except ValueError as e:
        raise ConfigError(f"--url {url}: not a URL ({e})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"--url {url}: expected http://HOST[:PORT] or https://HOST[:PORT]")


def parse_plan(ns) -> measure.BenchPlan:
    # `is None`, not falsy: an empty --contexts "" or --repeats "" is refused, not taken as the default
    raw = ns.contexts if ns.contexts is not None else (QUICK_CONTEXTS if ns.quick else DEFAULT_CONTEXTS)
    contexts = tuple(parse_value(parse_token_count, c, "--contexts") for c in raw.split(","))
    if ns.quick and ns.repeats is None:
        repeats = 1
    else:
        repeats = parse_value(int_range(1), "3" if ns.repeats is None else ns.repeats, "--repeats")
    return measure.BenchPlan(
        contexts=contexts,
        # decode tok/s times the tokens after the first: one generated token leaves nothing to time
        gen_tokens=parse_value(int_range(2), ns.gen, "--gen"),
        repeats=repeats,
        story_tokens=parse_value(int_range(0), ns.story_tokens, "--story-tokens"),
        warmup=not ns.no_warmup,
    )


def fit_contexts(plan: measure.BenchPlan, builder: PromptBuilder) -> measure.BenchPlan:
    """Drop contexts that the model's context cuts to the same size as an earlier one, saying so."""
    kept, sizes = [], {}
    for c in plan.contexts:
        n, note = builder.fit(c, plan.gen_tokens)
        if note:
            say(f"note: context {c}: {note}")
        if n in sizes:
            same = "listed twice" if c == sizes[n] else f"the same as context {sizes[n]} after the cut"
            say(f"note: context {c} is {same}; measured once")
            continue
        sizes[n] = c
        kept.append(c)
    return replace(plan, contexts=tuple(kept))


def progress_bar(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=f"strata_ray bench: {desc}", file=sys.stderr,
                disable=not sys.stderr.isatty(), leave=False)


OWN_JSON_KEY = {"--json-out": "mode", "--save": "outputs"}  # a key a bench report / gate reference holds


def check_own_json(path: str, flag: str, kind: str, key: str) -> None:
    """An existing JSON file at a --json-out / --save path must be one of ours (its format, kind and key):
    the "{" check let any JSON object through, and a serve.json given by mistake was replaced."""
    import json

    from strata_ray.capped_read import MIB, read_capped

    if not (os.path.isfile(path) and os.path.getsize(path) > 0):
        return
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.loads(read_capped(f, 64 * MIB))
    except (OSError, ValueError):  # too long, not UTF-8, not JSON
        doc = None
    if not (isinstance(doc, dict) and "format" in doc and "kind" in doc and key in doc):
        raise ConfigError(f"{flag}: {path} exists and is not {kind}; remove it or give another path")


def user_errors() -> tuple[type[BaseException], ...]:
    from strata_ray.bench.http_client import ServerError
    from strata_ray.engine.engine import RequestError
    from strata_ray.model.hparams import ModelFormatError

    return (ConfigError, ModelFormatError, PromptError, gate.GateFileError, report.PlotError, ServerError,
            RequestError)


def fail(message: str, code: int = 2) -> int:
    sys.stderr.write(f"strata_ray bench: {message}\n")
    sys.stderr.flush()
    return code


def bench_main(argv: Sequence[str]) -> int:
    argv = list(argv)
    command = argv[0] if argv and argv[0] in ("gate", "longgate") else "run"
    rest = argv[1:] if command != "run" else argv
    ns = build_parser(command).parse_args(rest)
    try:  # everything the user can get wrong fails here, before a model loads or Ray starts
        cfg = config_from_args(ns, os.environ)
        if ns.url is not None:
            check_url(ns.url)
        else:  # the --url flags without --url: a forgotten --url, not a no-op
            for flag in ("--api", "--served-model", "--api-key"):
                if getattr(ns, flag[2:].replace("-", "_")) is not None:
                    raise ConfigError(f"{flag} applies with --url only")
        if ns.url is not None or ns.local:  # the Ray flags where no Ray runs: refused, not a silent no-op
            for flag in ("--address", "--replace-actors"):
                if getattr(ns, flag[2:].replace("-", "_")) not in (None, False):
                    raise ConfigError(f"{flag} applies to the Ray actors only, not with "
                                      f"{'--url' if ns.url is not None else '--local'}")
        ns.api = ns.api or "chat"
        inputs = {"--model": cfg.model, "--against": getattr(ns, "against", None),
                  "--expert-profile": cfg.expert_profile, "--expert-profile-save": cfg.expert_profile_save}
        kinds = {"--json-out": (b"{", "a JSON report"), "--plot": (b"\x89PNG", "a PNG image"),
                 "--save": (b"{", "a gate reference")}
        for flag, (magic, kind) in kinds.items():
            path = getattr(ns, flag[2:].replace("-", "_"), None)
            if path == "":  # not "no file": a run whose report went nowhere, or --save read as --against
                raise ConfigError(f"{flag}: an empty path; give the file to write")
            if path:  # a file written after the whole run: refused now, not then; never over an input or
                # a file of another kind
                check_save_path(os.path.abspath(path), flag, inputs, magic, kind)
                if flag in OWN_JSON_KEY:
                    check_own_json(path, flag, kind, OWN_JSON_KEY[flag])
        hp = None
        if not ns.url:  # the model's header before any Ray work or load, as `run` reads it: a bad file fails
            # in a second
            from strata_ray.run import check_model_file, check_profile_files

            model_path, hp = check_model_file(cfg)
            if cfg.expert_profile or cfg.expert_profile_save:  # as `run` and `serve` read them
                cfg = check_profile_files(replace(cfg, model=model_path), hp)
        if command == "run":
            job = BenchJob(parse_plan(ns), parse_sampling(ns))
            if ns.plot:
                report.check_plot_available()
        elif ns.save:
            sampling = parse_sampling(ns)
            if sampling.temperature > 0 and sampling.seed is None:
                raise ConfigError("--save: a sampled gate (--temperature > 0) needs --seed: without one no "
                                  "later run can draw the same tokens")
            n = GATE_GEN_TOKENS if ns.max_tokens is None else parse_value(int_range(1), ns.max_tokens,
                                                                          "--max-tokens")
            job = GateJob(None, sampling, n)
        else:
            if ns.max_tokens is not None:
                raise ConfigError("--max-tokens applies with --save (--against runs the reference's count)")
            doc = gate.load(ns.against, command)
            job = GateJob(doc, reference_sampling(ns, doc), int(doc["gen_tokens"]))
        if hp is not None:  # a generation that leaves no room for a prompt, refused before the load
            PromptBuilder(context_length=hp.context_length).check_room(
                job.plan.gen_tokens if command == "run" else job.gen_tokens)
        if ns.url:  # the one seed a server cannot take, refused before the target opens
            from strata_ray.bench.http_client import check_wire_seed

            try:
                check_wire_seed(job.sampling.seed)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        with open_target(ns, cfg) as target:
            add_bos = bool(target.file and target.file.fields.get("tokenizer.ggml.add_bos_token", False))
            builder = PromptBuilder(target.tokenizer, target.context_length, add_bos, target.count_tokens)
            if command == "run":
                return run_bench(ns, job, target, builder, argv)
            return run_gate(ns, command, job, target, builder)
    except KeyboardInterrupt:
        return fail("interrupted", 130)
    except Exception as e:  # every failure ends in one line
        from strata_ray.actors import launch

        cause = launch.ray_cause(e)  # a user error raised in the primary: its line, not Ray's task header
        if isinstance(cause, user_errors()):
            return fail(launch.first_line(cause))

        # the Ray actors' runs: a failure Ray raised is the primary's (the actor every call goes to) or the
        # actor Ray names as dead; --local and --url run no actor
        actor = launch.failed_actor(e, launch.PRIMARY_NAME) if ns.url is None and not ns.local else None
        message, code = launch.describe_failure(e, actor)
        return fail(message, code)


@dataclass(frozen=True)
class BenchJob:
    plan: measure.BenchPlan
    sampling: object


@dataclass(frozen=True)
class GateJob:
    reference: dict | None  # the --against file; None with --save
    sampling: object
    gen_tokens: int


def run_bench(ns, job: BenchJob, target, builder: PromptBuilder, argv: list[str]) -> int:
    plan, sampling = fit_contexts(job.plan, builder), job.sampling
    with progress_bar(measure.plan_steps(plan), "measuring") as bar:
        results = measure.run_plan(target.runner, builder, plan, sampling,
                                   progress=lambda label: (bar.set_postfix_str(label), bar.update(1)))
    plan_doc = {
        "quick": ns.quick,
        "contexts": list(plan.contexts),
        "gen_tokens": plan.gen_tokens,
        "repeats": plan.repeats,
        "story_tokens": plan.story_tokens,
        "warmup": plan.warmup,
        "sampling": gate.sampling_record(sampling),
    }
    doc = report.build_report(
        "bench", target.mode, results, plan=plan_doc, config=target.config,
        model=report.model_info(target.file, target.path), device=report.device_info(target.engine_device),
        server=target.server, argv=["bench", *argv],
    )
    interrupted = bool(results.get("interrupted"))
    if interrupted and not results["contexts"]:
        raise KeyboardInterrupt  # nothing measured yet: the one line "interrupted"
    sys.stdout.write(report.table(doc) + "\n")
    sys.stdout.flush()
    written = True
    if ns.json_out:
        written = report.write_json(ns.json_out, doc)
        if written:
            say(f"wrote {ns.json_out}")
    if ns.plot:
        report.plot(doc, ns.plot)
        say(f"wrote {ns.plot}")
    if interrupted:
        say("interrupted: the table has what was measured before it")
        return 130
    return 0 if written else 1


def run_gate(ns, command: str, job: GateJob, target, builder: PromptBuilder) -> int:
    gen, sampling = job.gen_tokens, job.sampling
    if job.reference is None:
        fixed = builder.gate_prompts(gen) if command == "gate" else builder.longgate_prompts(gen)
        for p in fixed:
            if p.note:
                say(f"note: {p.name}: {p.note}")
        with progress_bar(len(fixed), command) as bar:
            outputs = gate.run_prompts(target.runner, fixed, gen, sampling, tick=lambda _n: bar.update(1))
        if not gate.save(ns.save, command, gen, sampling, outputs, gate_meta(target)):
            return 1
        for o in outputs:
            n = len(o.token_ids) if o.token_ids is not None else len(o.text)
            sys.stdout.write(f"  {o.name}: {o.prompt_tokens} prompt tokens, {n} generated\n")
        sys.stdout.write(f"saved {len(outputs)} {command} outputs to {ns.save}\n")
        return 0
    if target.file is not None:  # a reference another model wrote: refused before the run, not at the verdict
        gate.check_model(job.reference, report.model_info(target.file, target.path), ns.against)
    if target.tokenizer is not None:
        n_vocab = target.file.hparams.n_vocab if target.file is not None else target.tokenizer.n_vocab
        gate.check_vocab(job.reference, n_vocab, ns.against)
    prompts = gate.saved_prompts(job.reference, builder)
    with progress_bar(len(prompts), command) as bar:
        outputs = gate.run_prompts(target.runner, prompts, gen, sampling, tick=lambda _n: bar.update(1))
    lines, passed = gate.verdict(job.reference, outputs, target.tokenizer)
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()
    return 0 if passed else 1


def gate_meta(target) -> dict:
    """Where a gate reference came from, kept in the file (--against refuses another model's shape)."""
    return {
        "mode": target.mode,
        "model": report.model_info(target.file, target.path),
        "server": target.server,
        "engine_flags": report.engine_flags(target.config),
        "git": report.git_commit(),
        "versions": report.versions(),
    }
