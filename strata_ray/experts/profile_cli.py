"""`python -m strata_ray.run profile`: rank (layer, expert) pairs by how often a text routes to them.

Runs the reference forward over the corpus with a RoutingRecorder around the model's experts, then
writes the STRP ranking (`rank_from_counts`: frequency, ties by pair, never-routed pairs appended).
The corpus is fed as one sequence in chunks of --chunk tokens; the sequence restarts every --context
tokens so attention cost and memory stay bounded on a long corpus.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import numpy as np
import torch
from tqdm import tqdm

from strata_ray.capped_read import MIB, TooLong, read_capped
from strata_ray.config import (
    ENGINE_FLAGS,
    ConfigError,
    OneLineArgumentParser,
    check_save_path,
    decimal,
    parse_value,
)
from strata_ray.experts.profile import MAGIC, Profile, ProfileError, rank_from_counts, write_profile
from strata_ray.experts.recording import RoutingRecorder
from strata_ray.model.hparams import ModelFormatError
from strata_ray.model.routing_digest import routing_digest

CORPUS_LIMIT = 256 * MIB  # characters (a profile needs thousands of tokens, not billions)
PIECE_CHARS = MIB  # characters tokenized at a time, cut after a newline: --max-tokens stops the reading


class ProfileCliError(Exception):
    """A bad corpus or output path for `profile`; one line."""


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(
        prog="python -m strata_ray.run profile",
        error_prefix="strata_ray profile",  # as profile_main's other errors
        description="Record expert routing on a text and write an STRP expert profile (hottest pairs first).",
    )
    p.add_argument("--model", metavar="PATH", default=None,
                   help="GGUF model (default: STRATA_MODEL as the other commands read it, else the embedded "
                   "model; no other STRATA_* variable is read here)")
    p.add_argument("--corpus", metavar="FILE", required=True, help="UTF-8 text to route")
    p.add_argument("-o", "--output", metavar="P.strp", required=True, help="profile to write (atomic)")
    p.add_argument("--max-tokens", metavar="N", type=_positive, default=None, help="stop after N tokens")
    p.add_argument("--chunk", metavar="N", type=_positive, default=512, help="tokens per forward call (512)")
    p.add_argument("--context", metavar="N", type=_positive, default=2048,
                   help="restart the sequence every N tokens (2048; capped at the model's context)")
    p.add_argument("--device", default="cpu", help="torch device for the reference forward (cpu)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (none off a terminal either)")
    return p


def _positive(s: str) -> int:
    try:
        v = decimal(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def read_corpus(path: str) -> str:
    if not path.strip():  # `--corpus "$FILE"` with FILE unset: "corpus : No such file or directory" before
        raise ProfileCliError("--corpus: an empty path; give the text file to profile")
    try:
        with open(path, encoding="utf-8") as f:
            text = read_capped(f, CORPUS_LIMIT)
    except OSError as e:
        raise ProfileCliError(f"corpus {path}: {e.strerror or e}") from None
    except TooLong as e:
        raise ProfileCliError(f"corpus {path} is {e} (read whole: give a part of it)") from None
    except UnicodeDecodeError as e:  # a binary file would route its replacement characters, not text
        raise ProfileCliError(f"corpus {path} is not UTF-8 text (byte {e.start})") from None
    if not text.strip():
        raise ProfileCliError(f"corpus {path} is empty")
    return text


def record_routing(model, token_ids: Sequence[int], chunk: int, context: int, progress: bool = True) -> tuple:
    """Run `model` (a Model with .experts, .hp) over token_ids; returns (counts [L, X] int64, tokens)."""
    hp = model.hp
    recorder = RoutingRecorder(model.experts, hp.n_layer, hp.n_expert)
    inner, model.experts = model.experts, recorder
    ids = torch.as_tensor(np.asarray(token_ids, dtype=np.int64))
    try:
        show = progress and sys.stderr.isatty()  # no bar garbage in logs and pipes
        with torch.inference_mode(), tqdm(total=len(ids), unit="tok", desc="profile", file=sys.stderr,
                                          disable=not show, dynamic_ncols=True) as bar:
            for start in range(0, len(ids), context):
                state = model.new_state()  # a fresh sequence every `context` tokens
                window = ids[start : start + context]
                for s in range(0, len(window), chunk):
                    piece = window[s : s + chunk]
                    model.forward(piece, state)
                    bar.update(len(piece))
    finally:
        model.experts = inner  # the model is usable unchanged afterwards
    return recorder.counts(), recorder.tokens


def _check_device(name: str) -> None:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ProfileCliError(f"--device {name}: not a torch device") from None
    if device.type not in ("cpu", "cuda"):  # the engine's devices; torch knows more (mps, xpu, meta)
        raise ProfileCliError(f"--device {name}: the profile runs on cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ProfileCliError(f"--device {name}: CUDA is not available")


def profile_text(loaded, text: str, max_tokens: int | None, chunk: int, context: int,
                 progress: bool = True) -> tuple[Profile, np.ndarray, int]:
    """The profile of `text` for a LoadedModel; also the raw counts [L, X] and the tokens run."""
    token_ids = corpus_tokens(loaded.tokenizer, text, max_tokens, progress)
    if not token_ids:
        raise ProfileCliError("the corpus gives no tokens")
    context = min(context, loaded.hp.context_length) if loaded.hp.context_length > 0 else context
    counts, n_tokens = record_routing(loaded.model, token_ids, chunk, context, progress)
    # the model it was made on goes with it (model/routing_digest): another model of its shape is told
    return rank_from_counts(counts, model=routing_digest(loaded.file)), counts, n_tokens


def corpus_tokens(tokenizer, text: str, max_tokens: int | None, progress: bool = False) -> list[int]:
    """The corpus's ids, at most max_tokens: tokenized PIECE_CHARS at a time, each piece cut after a newline
    (where the pre-tokenizer splits anyway), until max_tokens are made. The whole text at once took ~165 bytes
    of memory a character (a 60 MB corpus 9.9 GB, for a --max-tokens 100 run) and minutes with no progress."""
    ids: list[int] = []
    start = 0
    with tqdm(total=len(text), desc="strata_ray profile: tokenizing", unit="char", unit_scale=True,
              file=sys.stderr, disable=not (progress and sys.stderr.isatty()), leave=False) as bar:
        while start < len(text) and (max_tokens is None or len(ids) < max_tokens):
            end = min(len(text), start + PIECE_CHARS)
            if end < len(text):
                cut = text.rfind("\n", start, end)
                end = cut + 1 if cut >= start else end
            ids.extend(tokenizer.encode(text[start:end]))
            bar.update(end - start)
            start = end
    return ids if max_tokens is None else ids[:max_tokens]


def profile_main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.model is None and os.environ.get("STRATA_MODEL"):  # as run, bench and serve take it: a
            # profile of the embedded model was written and then refused there for its shape
            args.model = parse_value(ENGINE_FLAGS["model"][2], os.environ["STRATA_MODEL"], "STRATA_MODEL")
        # fail before the long run, not after it; never over the model, the corpus or a file not a profile
        check_save_path(os.path.abspath(args.output), "-o", {"--model": args.model, "--corpus": args.corpus},
                        MAGIC, "an STRP profile")
        text = read_corpus(args.corpus)
        _check_device(args.device)
        from strata_ray.model.loader import load_model  # heavy import only once the flags are good

        loaded = load_model(args.model, device=args.device)
        profile, counts, n_tokens = profile_text(loaded, text, args.max_tokens, args.chunk, args.context,
                                                 progress=not args.no_progress)
        try:
            write_profile(args.output, profile)
        except OSError as e:  # a full disk: its path, not Python's name for the error
            print(f"strata_ray profile: cannot write {args.output} ({e.strerror or e})", file=sys.stderr)
            return 1
    except (ProfileCliError, ProfileError, ModelFormatError, ConfigError) as e:
        print(f"strata_ray profile: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # nothing was written: the profile is written whole at the end
        print("strata_ray profile: interrupted", file=sys.stderr)
        return 130
    print(
        f"strata_ray profile: {n_tokens} token{'s' * (n_tokens != 1)} routed through {profile.n_layers} "
        f"layers; "
        f"{int((counts > 0).sum())} of {counts.size} pairs used; wrote {args.output}",
        file=sys.stderr,
    )
    return 0
