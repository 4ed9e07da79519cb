"""Exactness gates: fixed greedy prompts whose output token ids must not change.

`gate --save ref.json` runs the prompts (chat, code ~4K tokens, math; `longgate`: one ~20K-token prompt)
and stores each prompt's text and the generated ids. `--against ref.json` runs the stored prompts again
(so the reference, not this version's prompt builder, defines them) and compares the ids exactly; a
server that returns no ids is compared by text. The verdict line is `GATE: PASS` or
`GATE: FAIL (n of N differ)`, each failure with its first differing position and the text around it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from strata_ray.bench.measure import Runner
from strata_ray.bench.prompts import Prompt, PromptBuilder
from strata_ray.capped_read import MIB, TooLong, read_capped

GATE_FORMAT = 1
MAX_TEMPERATURE = 100.0  # the --temperature flag's bound
GATE_FILE_LIMIT = 64 * MIB  # characters: longgate's ~20K-token prompt and its outputs take well under 1 MiB
CONTEXT_TOKENS = 12  # tokens of output shown before a difference
CONTEXT_CHARS = 40


class GateFileError(ValueError):
    """A reference file that cannot be read or is not a gate reference; one line."""


@dataclass(frozen=True)
class GateOutput:
    name: str
    prompt: str  # the user message
    prompt_tokens: int
    token_ids: tuple[int, ...] | None
    text: str
    note: str | None = None

    def record(self) -> dict:
        return {
            "name": self.name,
            "prompt": self.prompt,
            "prompt_tokens": self.prompt_tokens,
            "token_ids": None if self.token_ids is None else list(self.token_ids),
            "text": self.text,
            "note": self.note,
        }


def run_prompts(runner: Runner, prompts: list[Prompt], gen_tokens: int, sampling,
                tick=None) -> list[GateOutput]:
    outputs = []
    for p in prompts:
        t = runner.run(p, gen_tokens, sampling)
        outputs.append(GateOutput(p.name, p.content, t.prompt_tokens, t.token_ids, t.text, p.note))
        if tick:
            tick(p.name)
    return outputs


def sampling_record(sampling) -> dict:
    return {k: getattr(sampling, k) for k in ("temperature", "top_k", "top_p", "min_p", "seed")}


def save(path: str, kind: str, gen_tokens: int, sampling, outputs: list[GateOutput], meta: dict) -> bool:
    """The reference, whole or not at all (report.write_or_show: on stdout where it cannot be written)."""
    from strata_ray.bench.report import write_or_show

    doc = {
        "format": GATE_FORMAT,
        "kind": kind,
        "gen_tokens": gen_tokens,
        "sampling": sampling_record(sampling),
        **meta,
        "outputs": [o.record() for o in outputs],
    }
    return write_or_show(path, json.dumps(doc, ensure_ascii=False, indent=1) + "\n", "--save")


def load(path: str, kind: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:  # capped: /dev/zero was read until the memory ran out
            doc = json.loads(read_capped(f, GATE_FILE_LIMIT))
    except FileNotFoundError:
        raise GateFileError(f"--against: file not found: {path}") from None
    except TooLong as e:
        raise GateFileError(f"--against: {path} is {e}; a gate reference is a few MiB at most") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GateFileError(f"--against: {path} is not a JSON gate reference ({type(e).__name__})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("outputs"), list) or "gen_tokens" not in doc:
        raise GateFileError(f"--against: {path} is not a gate reference (no outputs); make one with --save")
    if doc.get("format") != GATE_FORMAT:
        found = json.dumps(doc.get("format"))
        raise GateFileError(f"--against: {path} is a gate reference of format {found}; this version reads "
                            f"format {GATE_FORMAT} (make one with --save)")
    if doc.get("kind") != kind:
        other = doc.get("kind")
        raise GateFileError(f"--against: {path} is a {other} reference (use `bench {other} --against`)")
    problem = _malformed(doc)
    if problem is not None:
        raise GateFileError(
            f"--against: {path} is not a valid gate reference ({problem}); make one with --save")
    return doc


SHAPE_KEYS = ("arch", "n_layer", "n_expert", "n_expert_used", "n_vocab")


def check_model(doc: dict, model: dict, path: str) -> None:
    """The reference's model (report.model_info, kept by --save) must have this model's shape: another
    model's tokens never match, and its ids would be read with this model's tokenizer. A reference that
    names no shape (a server's model) passes."""
    saved = doc.get("model") if isinstance(doc.get("model"), dict) else {}
    differ = [k for k in SHAPE_KEYS if saved.get(k) is not None and saved.get(k) != model.get(k)]
    if differ:
        was = ", ".join(f"{k} {saved[k]}" for k in differ)
        now = ", ".join(f"{k} {model.get(k)}" for k in differ)
        raise GateFileError(f"--against: {path} was made with another model ({was}; this one: {now})")


def check_vocab(doc: dict, n_vocab: int, path: str) -> None:
    """The reference's token ids must be this model's: GateFileError (one line) for one outside it."""
    for o in doc["outputs"]:
        bad = [t for t in o.get("token_ids") or () if not 0 <= t < n_vocab]
        if bad:
            raise GateFileError(f"--against: {path}: {o['name']} holds token id {bad[0]}, outside this "
                                f"model's vocabulary of {n_vocab} (a reference made with another model?)")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _malformed(doc: dict) -> str | None:
    """What in a reference's fields would break the run or the comparison (None: nothing)."""
    if not _is_int(doc["gen_tokens"]) or doc["gen_tokens"] < 1:
        return f"gen_tokens {json.dumps(doc['gen_tokens'])} is not an integer >= 1"
    if not doc["outputs"]:
        return "no outputs to compare"  # would pass without comparing anything
    for i, o in enumerate(doc["outputs"]):
        ids = o.get("token_ids") if isinstance(o, dict) else None
        if not (isinstance(o, dict) and isinstance(o.get("name"), str) and isinstance(o.get("prompt"), str)
                and isinstance(o.get("text", ""), str) and isinstance(o.get("note"), (str, type(None)))
                and (ids is None or (isinstance(ids, list) and all(_is_int(t) for t in ids)))):
            return f"outputs[{i}] is not an object with name, prompt, text and token_ids"
    sampling = doc.get("sampling", {})
    if not isinstance(sampling, dict):
        return "sampling is not an object"
    numbers = {"temperature": (int, float), "top_p": (int, float), "min_p": (int, float), "top_k": int}
    for key, kinds in numbers.items():
        v = sampling.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, kinds)):
            return f"sampling.{key} {json.dumps(v)} is not a number"
    if sampling.get("seed") is not None and not _is_int(sampling["seed"]):
        return f"sampling.seed {json.dumps(sampling['seed'])} is not an integer"
    temperature = sampling.get("temperature") or 0
    if not temperature <= MAX_TEMPERATURE:  # --temperature's bound (NaN fails it too; below 0: SamplingError)
        return f"sampling.temperature {json.dumps(temperature)} is above {MAX_TEMPERATURE:g}"
    if temperature > 0 and sampling.get("seed") is None:  # as --save refuses to make one
        return "sampled (temperature > 0) without a seed: no run can draw its tokens again"
    return None


def saved_prompts(doc: dict, builder: PromptBuilder) -> list[Prompt]:
    return [builder.message(o["name"], o["prompt"], o.get("note")) for o in doc["outputs"]]


# ---- comparison ------------------------------------------------------------------------------------------


def first_difference(a, b) -> int | None:
    """Index of the first element where a and b differ (a length difference counts), None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _token_text(tokenizer, ids, i: int) -> str:
    if i >= len(ids):
        return "<end>"
    shown = tokenizer.decode([ids[i]]) if tokenizer is not None else ""
    return f"{shown!r} (id {ids[i]})"


def compare(ref: dict, got: GateOutput, tokenizer=None) -> str | None:
    """None when equal, else one line naming the first differing position and its context."""
    ref_ids = ref.get("token_ids")
    if ref_ids is not None and got.token_ids is not None:
        i = first_difference(ref_ids, got.token_ids)
        if i is None:
            return None
        shown = list(ref_ids[max(0, i - CONTEXT_TOKENS):i])
        before = tokenizer.decode(shown) if tokenizer is not None else ""
        return (
            f"{got.name}: first difference at token {i} (reference {len(ref_ids)} tokens, now "
            f"{len(got.token_ids)}), context {before[-CONTEXT_CHARS:]!r}: reference "
            f"{_token_text(tokenizer, ref_ids, i)}, now {_token_text(tokenizer, got.token_ids, i)}"
        )
    ref_text = ref.get("text", "")
    i = first_difference(ref_text, got.text)
    if i is None:
        return None
    return (
        f"{got.name}: first difference at character {i} (compared by text: no token ids), context "
        f"{ref_text[max(0, i - CONTEXT_CHARS):i]!r}: reference {ref_text[i:i + CONTEXT_CHARS]!r}, "
        f"now {got.text[i:i + CONTEXT_CHARS]!r}"
    )


def verdict(doc: dict, outputs: list[GateOutput], tokenizer=None) -> tuple[list[str], bool]:
    """(lines to print, passed). The last line is `GATE: PASS` or `GATE: FAIL (n of N differ)`."""
    lines, failed = [], 0
    for ref, got in zip(doc["outputs"], outputs, strict=True):
        diff = compare(ref, got, tokenizer)
        if diff is None:
            how = "token ids" if ref.get("token_ids") is not None and got.token_ids is not None else "text"
            n = len(got.token_ids) if got.token_ids is not None else len(got.text)
            lines.append(f"  {got.name}: same {how} ({n} {'tokens' if how == 'token ids' else 'characters'})")
        else:
            failed += 1
            lines.append(f"  {diff}")
    lines.append("GATE: PASS" if failed == 0 else f"GATE: FAIL ({failed} of {len(outputs)} differ)")
    return lines, failed == 0
