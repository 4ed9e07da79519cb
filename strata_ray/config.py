"""EngineConfig: the one place where defaults, STRATA_* environment variables and CLI flags merge.

Precedence is defaults < environment < command line. The result is frozen and handed to the actors by
value; actors never read os.environ or sys.argv themselves. Model hyperparameters are not here: they come
only from the GGUF.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from strata_ray.kernels.attention_decode import attn_tiles_value
from strata_ray.kernels.contract import KERNEL_VARIANTS
from strata_ray.kernels.flag_wait import order_value
from strata_ray.kernels.gather_copy import gather_programs_value, stage_chunk_kib
from strata_ray.kernels.gdn_step import gdn_columns_value
from strata_ray.kernels.pdl import pdl_value

LOAN_ORDERS = ("profile", "prompt")  # STRATA_LOAN_ORDER: which pairs the ring's loan takes first

DEFAULT_MODEL_NAME = "strata-tiny-next"
PREFILL_MAX = 8192
PREFILL_ALIGN = 64  # GDN chunks are aligned to absolute positions, so prompt chunks are multiples of 64
SPEC_MAX_DRAFTS = 7  # verify window = drafts + 1 <= 8
PEER_RESERVE_FLOOR_MIB = 128
SEED_MAX = 2**64 - 1  # the sampler hashes 64-bit seeds (kernels/gumbel.draw_keys)


class ConfigError(Exception):
    """A bad flag, environment value or flag combination; one line, printed after 'strata_ray: '."""


# --- refusals (DESIGN section 4; the text is part of the interface) -------------------------------------
REFUSE_PEER_WITH_LAYER_SPLIT = "--peer-device cannot be combined with --layer-split (use one or the other)"
REFUSE_PEER_WITH_HELPER_CACHES = (
    "--peer-device cannot be combined with --expert-cache-device1..3 "
    "(the peer tier already caches experts there)"
)
REFUSE_PEER_WITHOUT_CACHE = "--peer-device needs --expert-profile and the expert cache"


def refuse_peer_not_visible(device: int, n_visible: int) -> str:
    return (
        f"peer experts: CUDA device {device} is not visible "
        f"({n_visible} devices; set CUDA_VISIBLE_DEVICES)"
    )


@dataclass(frozen=True)
class PeerEnv:
    """Tuning switches of the peer tier; read from the environment only when --peer-device is active."""

    peer_hot: float = 0.45  # STRATA_PEER_HOT: share of the top ranks moved behind the primary's fill; 0 = off
    peer_hot_at: int = 8700  # STRATA_PEER_HOT_AT: how many top ranks the HOT reorder looks at
    pf_peer_stream: float = 0.35  # STRATA_PF_PEER_STREAM: share of streamed prompt experts sent via the peer
    pf_peer_ring: int = 48  # STRATA_PF_PEER_RING: slots of the peer's prompt-path ring
    peer_direct: bool = True  # STRATA_PEER_DIRECT: P2P writes straight into the primary's row buffer
    pf_peer_compact: bool = True  # STRATA_PF_PEER_COMPACT: compact the peer's prompt rows before sending
    pf_peer_out_pipe: bool = True  # STRATA_PF_PEER_OUT_PIPE: pipeline the peer's output copies
    pf_gdn_split: bool = False  # STRATA_PF_GDN_SPLIT: split GDN prompt work (later)


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # None = the embedded default model
    device: str = "auto"  # cpu | cuda | auto (cuda when the cluster has GPUs)
    expert_cache: int | None = None  # primary expert slots; None = auto (free VRAM minus vram_reserve_mib)
    vram_budget_mib: int | None = None  # pretend the primary GPU has this much memory
    vram_reserve_mib: int = 700
    expert_profile: str | None = None  # STRP ranking that fills the caches
    expert_profile_save: str | None = None  # write the learned profile here (atomic)
    adapt_every: int = 4  # windows between adaptive rounds; 0 = off
    adapt_swaps: int = 96
    adapt_decay: float = 0.7
    peer_device: int = -1  # -1 = no peer tier
    peer_reserve_mib: int = 600
    peer_slots: int = 0  # 0 = all that fit
    peer_adapt_swaps: int = -1  # -1 = adapt_swaps
    peer_prefill_rows: int = -1  # -1 = chunk*K/2; 0 = off
    layer_split: str | tuple[int, ...] | None = None  # None = off, "auto", or stage start layers
    expert_cache_device1: int | str | None = None  # None = off, "auto" or a slot count
    expert_cache_device2: int | str | None = None
    expert_cache_device3: int | str | None = None
    prefill: int | None = None  # prompt chunk; None = auto (<= 8192)
    spec: int = 0  # MTP drafts per verify window
    # STRATA_ARENA_PIN_GIB (env only): cap on the pinned host store; None = auto (on CUDA: as much as the
    # host's available memory allows, experts.build.auto_pin_gib), 0 = none
    arena_pin_gib: float | None = None
    # STRATA_KERNEL_VARIANT (env only): GPU expert kernels, all with the same bits
    kernel_variant: str = KERNEL_VARIANTS[0]
    decode_graphs: bool = True  # STRATA_DECODE_GRAPHS=0 (env only): one-token forwards without CUDA graphs
    ring_overlap: bool = True  # STRATA_RING_OVERLAP=0 (env only): prompt ring copies on the compute stream
    # STRATA_DECODE_CPU_THREAD=1 (env only): on CUDA a helper thread computes a decode layer's CPU rows
    # behind a host flag while the host launches what follows; off: slower on the H200 (sessions 4-5: the
    # two threads' per-layer handoffs under the GIL cost more than the overlap wins)
    decode_cpu_thread: bool = False
    # STRATA_DECODE_PIPELINE (env only, default 1): on CUDA with decode graphs the whole decode token is
    # enqueued at once and a numba worker serves every layer's CPU rows behind device flags
    # (PipelinedDecodeRows; H200, 8K: 33.7 tok/s against 23.4); 0: DecodeRows, the host plans each layer
    decode_pipeline: bool = True
    # STRATA_DENSE_Q8 (env only, default 1): on CUDA the dense Q8_0 matrices stay Q8_0 in VRAM (a quarter of
    # float32's bytes: more expert cache in the same budget, and a quarter of the decode GEMVs' reads), and
    # Q4_K / Q6_K ones stay exact int8 codes with float32 chunk scales (kernels/dense_scaled: 1.5 / 1.25
    # bytes a weight); 0: float32 as on the CPU. The CPU path always dequantizes (the reference's
    # arithmetic).
    dense_q8: bool = True
    # STRATA_CPU_DENSE_BLOCKS (env only, default 0): on the CPU keep every quantized dense matrix as its GGUF
    # blocks in the file map and compute decode calls by the expert contract's kernels (int8 activations,
    # as llama.cpp; kernels/dense_blocks): a quarter of the float32 reads and no float32 copy in RAM. 0: the
    # float32 reference arithmetic.
    cpu_dense_blocks: bool = False
    # STRATA_PCIE_SHARE (env only, permille 0-1000): in the pipelined decode the GPU computes this share of
    # a layer's non-resident entries itself, copying their weights from the page-locked host store over
    # PCIe while the CPU pool computes the rest (contract.pcie_entries: those of the lowest expert ids); 0:
    # the CPU pool computes every miss. Same bits either way (the arithmetic contract). None (unset): from
    # the host's memory rate measured at load, P / (P + H) (experts/pcie_share: 300 on the H200 machine's 61
    # GB/s, 150 on the H100 machine's 140; a fixed 400 lost 6% at 8K there, session 41).
    pcie_share: int | None = None
    # STRATA_DECODE_PREFETCH (env only, 0-8 experts): in the pipelined decode each page-locked layer routes
    # its input residual beside its attention / GDN mixer (a prediction: the mixer adds little to the
    # residual) and copies the first this-many predicted non-resident experts into staging slots while the
    # host's memory and PCIe are otherwise idle; routed misses among them are the GPU's (decode_pipeline).
    # 0: off. Same bits either way. None (unset): 2 in the token graphs (STRATA_TOKEN_GRAPH, on by default,
    # where some experts are not resident: 77.2 -> 87.0 tok/s on the H200 at 8K, session 20), else 0 (there
    # each copy costs host launches: 94.5 -> 82.3 in session 19's form, 77 -> 70-75 in session 20's).
    decode_prefetch: int | None = None
    # STRATA_RING_LOAN (env only, default 1): on CUDA, while decoding, the prompt ring's slots (idle between
    # prompt chunks; ~1 GiB) hold the hottest pairs the cache does not, copied in a few steps after a prompt
    # and given back before the next prompt chunk (experts/residency: a loan). 0: the ring idles in decode.
    # Same bits either way (placement only).
    ring_loan: bool = True
    # STRATA_LOAN_ORDER (env only): which pairs the loan takes first. "prompt" (default): the last prompt's
    # routing counts first (a prompt routes every layer thousands of times: the hot experts of this request),
    # ties in the profile's order; on the H200 at 8K with a 24 GiB budget the hit rate over 64 tokens 0.547 ->
    # 0.605 and decode 98.9-105.8 -> 121.3-121.7 tok/s (session 28, two interleaved pairs). "profile": the
    # learned profile's order (heat of the decode windows since start, then the prior profile). Placement
    # only: the same bits either way.
    loan_order: str = "prompt"
    peer_env: PeerEnv = field(default_factory=PeerEnv)

    @property
    def peer_active(self) -> bool:
        return self.peer_device >= 0

    @property
    def resumes_profile(self) -> bool:
        """--expert-profile and --expert-profile-save name one file: each start resumes what the last one
        learned there (nothing there yet: a first start, not a missing file)."""
        return (self.expert_profile is not None and self.expert_profile_save is not None
                and os.path.abspath(self.expert_profile) == os.path.abspath(self.expert_profile_save))

    @property
    def peer_reserve_effective_mib(self) -> int:
        return max(self.peer_reserve_mib, PEER_RESERVE_FLOOR_MIB)

    @property
    def peer_adapt_swaps_effective(self) -> int:
        return self.adapt_swaps if self.peer_adapt_swaps < 0 else self.peer_adapt_swaps

    @property
    def helper_caches(self) -> tuple[int | str | None, ...]:
        return (self.expert_cache_device1, self.expert_cache_device2, self.expert_cache_device3)


# --- value parsers: each takes the raw string and returns the value or raises ValueError(allowed) ----------

_DECIMAL = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def decimal(s: str) -> int:
    """int(s) of ASCII digits with an optional sign, nothing else: int() also takes '٣', ' 3 ' and '1_0'."""
    if not _DECIMAL.fullmatch(s):
        raise ValueError(f"not a decimal integer: {s!r}")
    return int(s)


def plain_float(s: str) -> float:
    """float(s) of an ASCII decimal number (an exponent allowed), nothing else: float() also takes '٣',
    ' 1 ', '1_0', 'inf' and 'nan'."""
    if not _FLOAT.fullmatch(s):
        raise ValueError(f"not a decimal number: {s!r}")
    return float(s)



def int_range(lo: int, hi: int | None = None) -> Callable[[str], int]:
    allowed = f"an integer >= {lo}" if hi is None else f"an integer from {lo} to {hi}"

    def parse(s: str) -> int:
        try:
            v = decimal(s)
        except ValueError:
            raise ValueError(allowed) from None
        if v < lo or (hi is not None and v > hi):
            raise ValueError(allowed)
        return v

    return parse


def int_list(lo: int, hi: int | None = None) -> Callable[[str], tuple[int, ...]]:
    """An argparse type: comma-separated integers, each in int_range(lo, hi), at least one; a bad one is the
    flag's one-line error (the scripts' list flags: --depths 1024,8192)."""
    one = int_range(lo, hi)

    def parse(s: str) -> tuple[int, ...]:
        try:
            return tuple(one(part) for part in s.split(","))
        except ValueError as e:
            allowed = f"comma-separated, each {e}"
            raise argparse.ArgumentTypeError(f"invalid value {s!r} (allowed: {allowed})") from None

    return parse


def name_list(names) -> Callable[[str], tuple[str, ...]]:
    """An argparse type: comma-separated names, each one of `names`, at least one."""
    known = tuple(names)

    def parse(s: str) -> tuple[str, ...]:
        picked = tuple(s.split(","))
        bad = [n for n in picked if n not in known]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad[0]!r} (allowed: a comma-separated list of "
                                             f"{', '.join(known)})")
        return picked

    return parse


def float_range(lo: float, hi: float, lo_open: bool = False) -> Callable[[str], float]:
    allowed = f"a number {'>' if lo_open else '>='} {lo:g} and <= {hi:g}"

    def parse(s: str) -> float:
        try:
            v = plain_float(s)
        except ValueError:
            raise ValueError(allowed) from None
        if not (v > lo if lo_open else v >= lo) or v > hi:
            raise ValueError(allowed)
        return v

    return parse


def float_arg(lo: float, hi: float, lo_open: bool = False) -> Callable[[str], float]:
    """An argparse type: float_range(lo, hi, lo_open) with the flag's one-line error (the scripts' rates,
    temperatures and budgets: --hbm-gbs 3000)."""
    one = float_range(lo, hi, lo_open)

    def parse(s: str) -> float:
        try:
            return one(s)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"invalid value {s!r} (allowed: {e})") from None

    return parse


def seed_value(s: str) -> int:
    """A sampling seed: what the sampler takes (64 bits), so a big one fails here and not in the engine."""
    return int_range(0, SEED_MAX)(s)


def _auto_or(parse_int: Callable[[str], int], allowed: str,
             auto: tuple[str, ...] = ("auto",)) -> Callable[[str], int | None]:
    def parse(s: str) -> int | None:
        if s in auto:
            return None
        try:
            return parse_int(s)
        except ValueError:
            raise ValueError(allowed) from None

    return parse


def _helper_cache(s: str) -> int | str:
    if s == "auto":
        return "auto"
    try:
        return int_range(0)(s)
    except ValueError:
        raise ValueError("'auto' or an integer >= 0") from None


def _prefill(s: str) -> int | None:
    allowed = f"'auto' or a multiple of {PREFILL_ALIGN} from {PREFILL_ALIGN} to {PREFILL_MAX}"
    v = _auto_or(int_range(PREFILL_ALIGN, PREFILL_MAX), allowed)(s)
    if v is not None and v % PREFILL_ALIGN:
        raise ValueError(allowed)
    return v


def _layer_split(s: str) -> str | tuple[int, ...]:
    allowed = "'auto' or increasing layer numbers >= 1 separated by commas, e.g. 24 or 16,32"
    if s == "auto":
        return "auto"
    try:
        ks = tuple(decimal(k.strip()) for k in s.split(","))  # "16, 32" as "16,32"
    except ValueError:
        raise ValueError(allowed) from None
    if any(k < 1 for k in ks) or any(b <= a for a, b in zip(ks, ks[1:], strict=False)):
        raise ValueError(allowed)
    return ks


def _peer_device(s: str) -> int:
    allowed = "-1 (off) or a CUDA device number >= 1 (device 0 is the primary)"
    try:
        v = decimal(s)
    except ValueError:
        raise ValueError(allowed) from None
    if v != -1 and v < 1:
        raise ValueError(allowed)
    return v


def _choice(*options: str) -> Callable[[str], str]:
    def parse(s: str) -> str:
        if s not in options:
            raise ValueError(" or ".join(options))
        return s

    return parse


def _path(s: str) -> str:
    if not s:
        raise ValueError("a file path")
    return s


def _switch(s: str) -> bool:
    if s not in ("0", "1"):
        raise ValueError("0 or 1")
    return s == "1"


# field name -> (flag, metavar, parser, help). The field name doubles as the argparse dest; the environment
# variable is STRATA_<FIELD NAME UPPER>.
ENGINE_FLAGS: dict[str, tuple[str, str, Callable[[str], Any], str]] = {
    "model": ("--model", "PATH", _path,
              f"GGUF model file; a split file's first shard is enough "
              f"(default: the embedded {DEFAULT_MODEL_NAME})"),
    "device": ("--device", "cpu|cuda|auto", _choice("cpu", "cuda", "auto"),
               "where the primary runs (default auto: cuda when the cluster has a GPU, else cpu)"),
    # -1 as auto: the reference engine's spelling, which its users' scripts carry
    "expert_cache": ("--expert-cache", "N|auto",
                     _auto_or(int_range(0), "'auto', -1 (auto) or an integer >= 0", auto=("auto", "-1")),
                     "expert slots in the primary GPU's cache; 0 = none, every expert on the CPU "
                     "(default auto, also -1: free VRAM minus --vram-reserve-mib)"),
    "vram_budget_mib": ("--vram-budget-mib", "M", int_range(1),
                        "pretend the primary GPU has M MiB, to emulate a smaller card (default: off)"),
    "vram_reserve_mib": ("--vram-reserve-mib", "M", int_range(0),
                         "VRAM the automatic expert cache leaves free on the primary (default 700)"),
    "expert_profile": ("--expert-profile", "P", _path,
                       "STRP profile ranking (layer, expert) pairs; fills the caches hottest first"),
    "expert_profile_save": ("--expert-profile-save", "P", _path,
                            "save the profile learned by the adaptive rounds to P (atomic write); the same P "
                            "as --expert-profile resumes learning at each start (nothing at P yet: the "
                            "default order)"),
    "adapt_every": ("--adapt-every", "N", int_range(0),
                    "windows between adaptive cache rounds; 0 = off (default 4)"),
    "adapt_swaps": ("--adapt-swaps", "N", int_range(0), "most expert swaps per adaptive round (default 96)"),
    "adapt_decay": ("--adapt-decay", "F", float_range(0.0, 1.0, lo_open=True),
                    "usage decay per adaptive round, in (0, 1] (default 0.7)"),
    "peer_device": ("--peer-device", "N", _peer_device,
                    "second expert-cache tier on CUDA device N, reached over P2P (default -1 = off); "
                    "needs --expert-profile"),
    "peer_reserve_mib": ("--peer-reserve-mib", "M", int_range(0),
                         f"VRAM left free on the peer, at least {PEER_RESERVE_FLOOR_MIB} (default 600)"),
    "peer_slots": ("--peer-slots", "N", int_range(0),
                   "cap on the peer's expert slots (default 0 = all that fit)"),
    "peer_adapt_swaps": ("--peer-adapt-swaps", "N", int_range(-1),
                         "peer swaps per adaptive round (default -1 = --adapt-swaps)"),
    "peer_prefill_rows": ("--peer-prefill-rows", "N", int_range(-1),
                          "peer rows per layer in the prompt path (default -1 = chunk*K/2; 0 = off)"),
    "layer_split": ("--layer-split", "auto|K[,K2..]", _layer_split,
                    "pipeline split across GPUs: stage i+1 starts at layer Ki; auto picks the split "
                    "whose caches hold the most profile mass (default: off)"),
    **{
        f"expert_cache_device{i}": (f"--expert-cache-device{i}", "N|auto", _helper_cache,
                                    f"static helper expert cache on CUDA device {i} (default: off)")
        for i in (1, 2, 3)
    },
    "prefill": ("--prefill", "CHUNK|auto", _prefill,
                f"prompt chunk in tokens, a multiple of {PREFILL_ALIGN} up to {PREFILL_MAX} (default auto: "
                "4096 on CUDA, whose temporaries the auto expert cache leaves free; 512 on CPU)"),
    "spec": ("--spec", "N", int_range(0, SPEC_MAX_DRAFTS),
             f"MTP drafts per verify window, 0..{SPEC_MAX_DRAFTS} (window = N+1 tokens; default 0 = off)"),
}

# the flags whose engine part has not landed: --help says so (engine.unavailable_feature refuses a run that
# uses one, in one line)
NOT_LANDED = ("peer_device", "layer_split", "expert_cache_device1", "expert_cache_device2",
              "expert_cache_device3", "spec")

# env var -> (PeerEnv field, parser)
PEER_ENV_SWITCHES: dict[str, tuple[str, Callable[[str], Any]]] = {
    "STRATA_PEER_HOT": ("peer_hot", float_range(0.0, 1.0)),
    "STRATA_PEER_HOT_AT": ("peer_hot_at", int_range(0)),
    "STRATA_PF_PEER_STREAM": ("pf_peer_stream", float_range(0.0, 1.0)),
    "STRATA_PF_PEER_RING": ("pf_peer_ring", int_range(1)),
    "STRATA_PEER_DIRECT": ("peer_direct", _switch),
    "STRATA_PF_PEER_COMPACT": ("pf_peer_compact", _switch),
    "STRATA_PF_PEER_OUT_PIPE": ("pf_peer_out_pipe", _switch),
    "STRATA_PF_GDN_SPLIT": ("pf_gdn_split", _switch),
}


def env_name(field_name: str) -> str:
    return "STRATA_" + field_name.upper()


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse that ends a bad command line with one line and exit code 2 instead of usage + message.
    error_prefix: what the command's other errors start with (`strata_ray bench`, `strata_ray profile`)."""

    def __init__(self, *args, error_prefix: str = "strata_ray", **kwargs):
        kwargs.setdefault("allow_abbrev", False)  # `--max-token 3` is a typo, not --max-tokens
        super().__init__(*args, **kwargs)
        self.error_prefix = error_prefix

    def error(self, message: str):  # noqa: D401 - argparse API
        self.exit(2, f"{self.error_prefix}: {message} (see --help)\n")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine flags of DESIGN section 4. Values stay strings here: config_from_args validates them, so a
    flag and its STRATA_* environment twin go through the same checks and messages."""
    group = parser.add_argument_group(
        "engine",
        "each flag can also be set by the environment variable STRATA_<FLAG> "
        "(e.g. STRATA_PREFILL=512); flags win over the environment",
    )
    for name, (flag, metavar, _parse, help_text) in ENGINE_FLAGS.items():
        if name in NOT_LANDED:  # parsed and checked; a run that uses it is refused (engine.check_supported)
            help_text += "; not available yet"
        group.add_argument(flag, dest=name, metavar=metavar, default=None, help=help_text)
    defaults = PeerEnv()
    lines = [f"  {var} [{_show(getattr(defaults, name))}]" for var, (name, _) in PEER_ENV_SWITCHES.items()]
    parser.epilog = "\n".join(
        ["peer-tier environment switches, read only with --peer-device (default in brackets):", *lines]
    )


def _show(v: object) -> str:
    return str(int(v)) if isinstance(v, bool) else str(v)


def build_arg_parser(
    prog: str = "python -m strata_ray.run", description: str | None = None, error_prefix: str = "strata_ray"
) -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(
        prog=prog,
        error_prefix=error_prefix,
        description=description
        or "Run a Mixture-of-Experts GGUF model on Ray. Without --model it runs the embedded "
        f"{DEFAULT_MODEL_NAME}, a small Qwen3-Next with MTP trained on Python's documentation.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_engine_args(parser)
    return parser


def parse_value(parse: Callable[[str], Any], raw: str, label: str) -> Any:
    try:
        return parse(raw)
    except ValueError as e:
        raise ConfigError(f"{label}: invalid value {raw!r} (allowed: {e})") from None


def _on(s: str) -> bool:
    """A 0 / 1 switch as a bool."""
    return _choice("0", "1")(s) == "1"


def ring_slots_value(s: str) -> int:
    """STRATA_RING_SLOTS: an even count >= 2, digits only (the ring's two halves alternate across layers).
    experts/build reads it with this same parser."""
    if not (s.isascii() and s.isdigit()) or int(s) < 2 or int(s) % 2:
        raise ValueError("an even count >= 2")
    return int(s)


# EngineConfig fields set by a STRATA_* variable alone (no flag): variable -> (field, parse)
ENV_FIELDS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "STRATA_ARENA_PIN_GIB": ("arena_pin_gib", float_range(0.0, 1e6)),
    "STRATA_KERNEL_VARIANT": ("kernel_variant", _choice(*KERNEL_VARIANTS)),
    "STRATA_DECODE_GRAPHS": ("decode_graphs", _on),
    "STRATA_RING_OVERLAP": ("ring_overlap", _on),
    "STRATA_DECODE_CPU_THREAD": ("decode_cpu_thread", _on),
    "STRATA_DENSE_Q8": ("dense_q8", _on),
    "STRATA_CPU_DENSE_BLOCKS": ("cpu_dense_blocks", _on),
    "STRATA_DECODE_PIPELINE": ("decode_pipeline", _on),
    "STRATA_RING_LOAN": ("ring_loan", _on),
    "STRATA_LOAN_ORDER": ("loan_order", _choice(*LOAN_ORDERS)),
    "STRATA_PCIE_SHARE": ("pcie_share", int_range(0, 1000)),
    "STRATA_DECODE_PREFETCH": ("decode_prefetch", int_range(0, 8)),
}


def config_from_args(ns: argparse.Namespace, env: Mapping[str, str] | None = None) -> EngineConfig:
    """Merge defaults < STRATA_* env < CLI and validate. Raises ConfigError with one line."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for name, (flag, _metavar, parse, _help) in ENGINE_FLAGS.items():
        raw_cli = getattr(ns, name, None)
        if raw_cli is not None:
            values[name] = parse_value(parse, str(raw_cli), flag)
        elif env.get(env_name(name), "") != "":
            values[name] = parse_value(parse, env[env_name(name)], env_name(name))
    for name, (field_name, parse) in ENV_FIELDS.items():
        if env.get(name, "") != "":
            values[field_name] = parse_value(parse, env[name], name)
    for name, parse in READ_WHERE_USED.items():  # switches the kernels read themselves: refused here first
        if env.get(name, "") != "":
            parse_value(parse, env[name], name)
    cfg = EngineConfig(**values)
    _check_combinations(cfg)
    if cfg.peer_active:
        cfg = _with_peer_env(cfg, env)
    return cfg


# env-only A/B switches read where they act (kernels, decode graphs), not carried by EngineConfig: a value
# they would not take is refused with the others' one line (STRATA_FUSED_DECODE, STRATA_GATHER_COPY and
# STRATA_STREAM_ALL and STRATA_DENSE_CUDA: 0 turns them off; STRATA_DECODE_DEVICE_ATTENTION: 1 turns it on
# (default: on in the token graphs, off otherwise);
# STRATA_WORDS_CUDA: either, over kernels/expert_words.WORDS["cuda"]; STRATA_PROMPT_MMA: either, over
# kernels/expert_mma_cuda.MMA["on"]; STRATA_PREFETCH_LAYERS: how far ahead the prompt path copies a layer's
# experts, experts/tiered; STRATA_ATTN_DOT: the decode attention's products, STRATA_ATTN_TILES its key
# tiles, kernels/attention_decode; STRATA_TOKEN_GRAPH: the pipelined decode's layers as one graph (1)
# or a graph or two each (0; default: 1 where some experts are not resident), experts/decode_pipeline;
# STRATA_TOKEN_GRAPH_LAYERS: the most layers a token graph holds (0: no limit), model/decode_graph;
# STRATA_DECODE_CHAIN: 0 turns off the chained greedy decode (each token launched before the host reads
# the one before; default on where the token graphs run), model/decode_graph;
# STRATA_AHEAD_PROGRAMS / STRATA_SHARE_PROGRAMS: the programs of the decode's copies ahead / of its PCIe
# share's copy, kernels/gather_copy; STRATA_DECODE_WARM: the worker reads each layer's predicted CPU rows
# ahead, experts/decode_pipeline; STRATA_TEAM_FORM: the decode worker's team form, gather, dynamic or counter,
# experts/decode_pipeline; STRATA_DOWN_PREFETCH: the team's down units prefetched, experts/decode_pipeline;
# STRATA_TEAM_UNITS: the team's gate/up units, half or whole tiles, experts/decode_pipeline;
# STRATA_MMA_KQUANT_CTAS: the CTAs an SM the K-quant prompt rows' registers are capped for,
# kernels/expert_mma_cuda; STRATA_MMA_FULL_TILES: 1 / 0 the prompt rows' full-tile form, over
# MMA["full_tiles"], the same; STRATA_GEMV_MIN_CTAS: the same for the dense Q8_0 GEMV, kernels/dense_q8_cuda;
# STRATA_AHEAD_LAYER: where a layer's copies ahead are picked, same or next, experts/decode_pipeline;
# STRATA_ROWS_ITERS: about how many row blocks a CTA of the CUDA decode expert rows walks in both launches,
# over kernels/expert_words.WORDS["cuda_iters"] and ["cuda_down_iters"], kernels/expert_rows_cuda;
# STRATA_ROWS_EARLY: 1 / 0 the CUDA decode expert rows' EARLY prologue, over WORDS["cuda_early"], the same;
# STRATA_GDN_COLUMNS: the value columns a GDN delta program takes, kernels/gdn_step; STRATA_PDL: 0 launches
# the decode chain's kernels without programmatic dependent launch, kernels/pdl; STRATA_FLAG_ORDER: the
# in-graph host-flag wait's loads, acquire, fence or relaxed, kernels/flag_wait)
READ_WHERE_USED: dict[str, Callable[[str], object]] = {
    "STRATA_FUSED_DECODE": _choice("0", "1"),
    "STRATA_GATHER_COPY": _choice("0", "1"),
    "STRATA_STREAM_ALL": _choice("0", "1"),
    "STRATA_DECODE_DEVICE_ATTENTION": _choice("0", "1"),
    "STRATA_WORDS_CUDA": _choice("0", "1"),
    "STRATA_PROMPT_MMA": _choice("0", "1"),
    "STRATA_DENSE_CUDA": _choice("0", "1"),
    "STRATA_ATTN_DOT": _choice("tf32x3", "ieee"),
    "STRATA_ATTN_TILES": attn_tiles_value,
    "STRATA_STAGE_CHUNK_KIB": stage_chunk_kib,
    "STRATA_GATHER_PROGRAMS": gather_programs_value,
    "STRATA_AHEAD_PROGRAMS": gather_programs_value,
    "STRATA_SHARE_PROGRAMS": gather_programs_value,
    "STRATA_PREFETCH_LAYERS": _choice("1", "2"),
    "STRATA_TOKEN_GRAPH": _choice("0", "1"),
    "STRATA_TOKEN_GRAPH_LAYERS": int_range(0, 1 << 16),
    "STRATA_DECODE_CHAIN": _choice("0", "1"),
    "STRATA_DECODE_WARM": _choice("0", "1"),
    "STRATA_TEAM_FORM": _choice("gather", "dynamic", "counter"),
    "STRATA_DOWN_PREFETCH": _choice("0", "1"),
    "STRATA_TEAM_UNITS": _choice("half", "whole"),
    "STRATA_MMA_KQUANT_CTAS": int_range(1, 4),
    "STRATA_MMA_FULL_TILES": _choice("0", "1"),
    "STRATA_GEMV_MIN_CTAS": int_range(1, 4),
    "STRATA_PRECOMPILE": _choice("0", "1"),
    "STRATA_RING_SLOTS": ring_slots_value,
    "STRATA_AHEAD_LAYER": _choice("same", "next"),
    "STRATA_ROWS_ITERS": int_range(1, 64),
    "STRATA_ROWS_EARLY": _choice("0", "1"),
    "STRATA_GDN_COLUMNS": gdn_columns_value,
    "STRATA_PDL": pdl_value,
    "STRATA_FLAG_ORDER": order_value,
}
# read by the engine's own processes, never set by a user: allowed in serve.json's env all the same
INTERNAL_ENV = ("STRATA_PRECOMPILE_PARENT",)


def known_env_names() -> set[str]:
    """Every STRATA_* variable the engine reads (serve.json's env refuses the others: a typo)."""
    return ({env_name(name) for name in ENGINE_FLAGS} | set(ENV_FIELDS) | set(PEER_ENV_SWITCHES)
            | set(READ_WHERE_USED) | set(INTERNAL_ENV))


def actor_switches(environ: Mapping[str, str]) -> dict[str, str]:
    """The STRATA_* switches set in a driver's environment, which its actors must see: an attached cluster's
    actors run in its raylet's environment, not the driver's (a local instance inherits the driver's), so
    the switches the kernels read where used were checked here and then silently off there."""
    internal = set(INTERNAL_ENV)
    return {k: v for k, v in environ.items() if k in known_env_names() and k not in internal}


def switches_outside_config(switches: Mapping[str, str]) -> dict[str, str]:
    """Of actor_switches, those the EngineConfig does not carry (read where used): a kept engine is reused
    only with the same (the engine flags' variables are compared through the config)."""
    return {k: v for k, v in switches.items() if k in READ_WHERE_USED}


def _check_combinations(cfg: EngineConfig) -> None:
    if cfg.peer_active:
        if cfg.layer_split is not None:
            raise ConfigError(REFUSE_PEER_WITH_LAYER_SPLIT)
        if any(h is not None for h in cfg.helper_caches):
            raise ConfigError(REFUSE_PEER_WITH_HELPER_CACHES)
        if cfg.expert_profile is None or cfg.expert_cache == 0 or cfg.device == "cpu":
            raise ConfigError(REFUSE_PEER_WITHOUT_CACHE)
    if cfg.expert_profile is not None and not cfg.resumes_profile:  # resume: nothing there yet: first start
        if os.path.isdir(cfg.expert_profile):
            raise ConfigError(f"--expert-profile: {cfg.expert_profile} is a folder, not an STRP file")
        if not os.path.exists(cfg.expert_profile):
            raise ConfigError(f"--expert-profile: file not found: {cfg.expert_profile}")
        if not os.path.isfile(cfg.expert_profile):  # /dev/zero, a FIFO: "not found" sent the user looking
            raise ConfigError(f"--expert-profile: {cfg.expert_profile} is not a regular file; give an STRP "
                              "file")


def _with_peer_env(cfg: EngineConfig, env: Mapping[str, str]) -> EngineConfig:
    values = {}
    for var, (name, parse) in PEER_ENV_SWITCHES.items():
        if env.get(var, "") != "":
            values[name] = parse_value(parse, env[var], var)
    return replace(cfg, peer_env=PeerEnv(**values))


def check_peer_device_visible(cfg: EngineConfig, n_visible: int) -> None:
    """Refusal 4: run where the peer's GPU should be (the driver of a local cluster, and the primary)."""
    if cfg.peer_active and cfg.peer_device >= n_visible:
        raise ConfigError(refuse_peer_not_visible(cfg.peer_device, n_visible))


def check_save_path(path: str, flag: str, inputs: Mapping[str, str | None] | None = None,
                    magic: bytes | None = None, kind: str = "") -> None:
    """A file path the run can write later (checked now, so a long run does not fail at its end): its folder
    exists and a file can be made there, and the path itself is not a folder, a device or a FIFO (a symbolic
    link is written through: atomic_file.write_atomic). inputs {flag: path}: the files the run
    reads, none of which it may overwrite; magic: an existing file there must start with it (a `kind` file
    of an earlier run), so that a mistyped path never replaces a model, a corpus or any other file.
    ConfigError (one line) otherwise."""
    from strata_ray.atomic_file import probe_folder, regular_target

    try:
        target = regular_target(path)  # the file write_atomic replaces: the one a symbolic link leads to
    except IsADirectoryError:
        raise ConfigError(f"{flag}: {path} is a folder; give a file path") from None
    except OSError:  # /dev/null, a FIFO: the save would replace it
        raise ConfigError(f"{flag}: {path} is not a regular file; give a file path") from None
    folder = os.path.dirname(target if os.path.islink(path) else path)  # the user's spelling unless a link
    if not os.path.isdir(folder):
        raise ConfigError(f"{flag}: folder not found: {folder}")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ConfigError(f"{flag}: {path} is not writable")
    try:
        probe_folder(folder)  # where the permission bits say yes and a file cannot be made (/proc)
    except OSError as e:
        raise ConfigError(f"{flag}: {path} is not writable: a file cannot be made in {folder} "
                          f"({e.strerror or e})") from None
    for other, source in (inputs or {}).items():
        if source and os.path.exists(source) and os.path.exists(path) and os.path.samefile(source, path):
            raise ConfigError(f"{flag}: {path} is the {other} file; give another path")
    other_kind = magic is not None and os.path.isfile(path) and os.path.getsize(path) > 0
    if other_kind and not starts_with(path, magic):
        raise ConfigError(f"{flag}: {path} exists and is not {kind}; remove it or give another path")


def starts_with(path: str | os.PathLike, magic: bytes) -> bool:
    """The file at path begins with magic (a format's signature); False where it cannot be read."""
    try:
        with open(path, "rb") as f:
            return f.read(len(magic)) == magic
    except OSError:
        return False
