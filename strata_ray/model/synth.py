"""`synth`: random-weight GGUF models at real shapes, streamed to disk fast, with Zipf-skewed routers.

    python -m strata_ray.run synth --arch qwen3next --preset 80b-a3b -o big.gguf

Weights are random quant blocks with std ~ 1/sqrt(fan_in) (synth_blocks). Two choices keep the model
well-behaved through all layers and make its routing skewed like a trained model's:
- residual-writing projections (attn_output, ssm_out, ffn_down_*) are scaled down by RESIDUAL_GAIN so the
  summed layer outputs stay about as large as the embedding, whatever the depth;
- every token embedding shares a component along one fixed direction u (like the mean/outlier direction of
  real hidden states), which therefore survives in every layer's normed hidden state x, and router row e
  carries -s * log(1 + rank_e) / (x . u) along u: logits get a Zipf-law bias in the per-layer rank (a random
  permutation per layer) plus per-token noise from the random part; s is calibrated per (n_expert, top-k)
  so the top quarter of experts gets TOP_QUARTER_SHARE of the selections (zipf_exponent).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import math
import os
import shutil
import signal
import sys
import threading
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T

from .gguf_writer import GGUFWriteError, ModelWriter, byte_level_tokenizer_spec, produced_chunks
from .hparams import HParams
from .quants import BLOCK, type_name
from .synth_blocks import Q8_0_SD, RandomBlocks
from .synth_blocks import SUPPORTED as RANDOM_BLOCK_TYPES
from .synth_presets import ARCHS, PRESETS, SynthError, preset_hparams
from .tensor_layout import is_expert_tensor, keeps_float, tensor_layout

EXPERT_TYPES = ("Q4_0", "Q8_0", "Q4_K", "Q6_K")
DENSE_TYPES = ("Q8_0", "Q4_K", "Q6_K")  # --dense-type: Q8_0 (default), or a Q4_K_M file's K-quant matrices
SHARED_DIRECTION = ("token_embd.weight", "nextn.eh_proj.weight")  # Q8_0 always: their values carry u
CHUNK_BYTES = 16 << 20  # one chunk of a streamed tensor

ROUTER_NOISE = 1.3  # std of the random part of router logits (per token and expert)
TOP_QUARTER_SHARE = 0.55  # target: the most popular 25% of a layer's experts get 55% of the selections
EMBD_NOISE, EMBD_SHARED = 64, 24  # token_embd int8 values: uniform noise in [-64, 63] + EMBD_SHARED * sign(u)
EMBD_COS = EMBD_SHARED / math.hypot(EMBD_NOISE / math.sqrt(3), EMBD_SHARED)  # cos(embedding, u)
LAYER_OUT_VAR = 0.6  # variance one layer adds to the residual at RESIDUAL_GAIN 1 (unit-rms inputs)


def residual_gain(n_layer: int) -> float:
    """Scale of residual-writing projections: all layers together add about one embedding's variance."""
    return min(1.0, 1.0 / math.sqrt(LAYER_OUT_VAR * n_layer))


def expected_cos_u(hp: HParams, layer: int) -> float:
    """Expected cos(layer's normed MoE input, u): the embedding share, diluted by earlier layer outputs
    (for the MTP layer: the share eh_proj gives its output, see mtp_shared_int)."""
    if layer >= hp.n_layer:
        return _mtp_cos(hp)[1]
    return EMBD_COS / math.sqrt(1.0 + (layer + 0.5) / hp.n_layer)


MTP_COS = 0.5  # wanted cos(eh_proj output, u), so the MTP layer's router is skewed like the trunk's


def _mtp_cos(hp: HParams) -> tuple[int, float]:
    """(int shared part m of eh_proj's Q8_0 values, resulting cos of its output with u).

    eh_proj [E, 2E] = d * (noise [-64, 63] + m * s_i * [s, s]_j); its input [enorm(embd), hnorm(hidden)] has
    u-cosines c_e (embedding) and c_h (final hidden), each half of norm sqrt(E). Per output the shared part is
    m * E * (c_e + c_h), the noise part has std 64/sqrt(3) * sqrt(2E): solve for m, round, give the cos."""
    E = hp.n_embd
    shared = E * (EMBD_COS + EMBD_COS / math.sqrt(2.0))
    noise = EMBD_NOISE / math.sqrt(3) * math.sqrt(2 * E)
    m = max(1, round(noise * MTP_COS / (shared * math.sqrt(1 - MTP_COS**2))))
    # the MTP block's attention adds about half a trunk layer's share of variance before the router
    return m, m * shared / math.hypot(noise, m * shared) / math.sqrt(1.0 + 0.5 / hp.n_layer)


@functools.cache
def zipf_exponent(n_expert: int, n_used: int, share: float = TOP_QUARTER_SHARE) -> float:
    """s such that top-k routing over logits -s*log(1+rank) + N(0, ROUTER_NOISE^2) gives the top quarter of
    experts `share` of all selections (bisection on a fixed sample; selection share grows with s)."""
    quarter = max(1, n_expert // 4)
    if n_used >= n_expert or share <= quarter / n_expert:
        return 0.0
    noise = np.random.default_rng(0x21F).standard_normal((2048, n_expert)) * ROUTER_NOISE
    log_rank = np.log1p(np.arange(n_expert))

    def top_quarter_share(s: float) -> float:
        chosen = np.argpartition(noise - s * log_rank, n_expert - n_used, axis=1)[:, n_expert - n_used :]
        return float(np.mean(chosen < quarter))  # column index == popularity rank here

    lo, hi = 0.0, 8.0
    for _ in range(20):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if top_quarter_share(mid) < share else (lo, mid)
    return (lo + hi) / 2


def synth_type(name: str, shape: Sequence[int], expert_type: int, dense_type: int = T.Q8_0) -> int:
    """F32 where llama-quantize keeps floats, expert_type for routed experts, dense_type for other matrices
    (Q8_0 for the embedding and MTP projection, whose values carry the shared direction); falls back (like
    llama-quantize) to Q8_0, then F32, when a row is not a multiple of the block."""
    if keeps_float(name, tuple(shape)):
        return T.F32
    t = expert_type if is_expert_tensor(name) else dense_type
    if name.endswith(SHARED_DIRECTION):
        t = T.Q8_0
    for cand in (t, T.Q8_0):
        if shape[-1] % BLOCK[cand][0] == 0:
            return cand
    return T.F32


class SynthModel:
    """Value producers for every tensor of one synthetic model (deterministic per seed and tensor name)."""

    def __init__(self, hp: HParams, seed: int = 0):
        self.hp, self.seed = hp, seed
        self.blocks = RandomBlocks(seed)
        # the shared hidden direction: u = signs / sqrt(E)
        self.signs = np.where(np.random.default_rng([seed, 0xD1]).random(hp.n_embd) < 0.5, -1, 1).astype(
            np.int8
        )
        self.gain = residual_gain(hp.n_layer)

    def rng(self, name: str) -> np.random.Generator:
        return np.random.default_rng([self.seed, zlib.crc32(name.encode())])

    def producer(self, name: str, shape: tuple[int, ...], ggml_type: int):
        if ggml_type == T.F32:
            return lambda: self._float(name, shape)
        if name == "token_embd.weight" and ggml_type == T.Q8_0:  # every token shares u
            ones = np.ones(shape[0], np.int8)
            return lambda: self._shared_direction(name, shape, ones, self.signs, EMBD_SHARED, 1.0)
        if name.endswith("nextn.eh_proj.weight") and ggml_type == T.Q8_0:  # maps u in its input to u
            m, two = _mtp_cos(self.hp)[0], np.concatenate([self.signs, self.signs])
            return lambda: self._shared_direction(name, shape, self.signs, two, m, 1 / math.sqrt(shape[-1]))
        fan_in = shape[-1]
        writes_residual = name.endswith(
            ("attn_output.weight", "ssm_out.weight", "down_exps.weight", "down_shexp.weight")
        )
        std = (self.gain if writes_residual else 1.0) / math.sqrt(fan_in)
        if ggml_type in RANDOM_BLOCK_TYPES:
            return lambda: self._random_blocks(name, shape, ggml_type, std)
        return lambda: self.rng(name).standard_normal(shape, dtype=np.float32) * np.float32(std)  # F16/BF16

    def _row_chunks(self, shape: tuple[int, ...], row_bytes: int) -> Iterator[int]:
        rows = int(np.prod(shape[:-1]))
        step = max(1, CHUNK_BYTES // row_bytes)
        for start in range(0, rows, step):
            yield min(step, rows - start)

    def _random_blocks(self, name: str, shape, ggml_type: int, std: float) -> Iterator[np.ndarray]:
        rng = self.rng(name)
        elems, size = BLOCK[ggml_type]
        for n in self._row_chunks(shape, shape[-1] // elems * size):
            yield self.blocks.blocks(rng, n, shape[-1], ggml_type, std)

    def _shared_direction(
        self, name: str, shape, row_signs, col_signs, m: int, rms: float
    ) -> Iterator[np.ndarray]:
        """Q8_0 rows: uniform int noise in [-64, 63] plus m * row_sign * col_signs (a rank-1 share along
        u), element rms ~ rms."""
        rng, cols = self.rng(name), shape[-1]
        shared_cols = (m * col_signs.astype(np.int16)).reshape(cols // 32, 32)
        d = Q8_0_SD * rms / math.hypot(EMBD_NOISE / math.sqrt(3), m)  # blocks() aims its int8 at Q8_0_SD
        row = 0
        for n in self._row_chunks(shape, cols // 32 * 34):
            b = self.blocks.blocks(rng, n, cols, T.Q8_0, d).reshape(n, cols // 32, 34)
            qs = b[:, :, 2:].view(np.int8)
            shared = row_signs[row : row + n, None, None].astype(np.int16) * shared_cols  # [n, cols/32, 32]
            qs[...] = (qs.astype(np.int16) >> 1) + shared  # |m| <= 63 keeps it in int8
            row += n
            yield b.reshape(n, -1)

    def _float(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        rng, hp = self.rng(name), self.hp
        if name.endswith("norm.weight"):  # every RMSNorm weight (GGUF stores the +1 folded in): ~1
            return rng.uniform(0.9, 1.1, shape).astype(np.float32)
        if name.endswith("ffn_gate_inp.weight"):
            return self._router(name, shape, rng)
        if name.endswith("ssm_a"):  # -exp(A_log), A ~ U(1, 16) as in the HF init
            return -rng.uniform(1.0, 16.0, shape).astype(np.float32)
        if name.endswith("ssm_dt.bias"):  # Mamba init: softplus(dt_bias) = dt ~ logU(1e-3, 1e-1)
            dt = np.exp(rng.uniform(math.log(1e-3), math.log(1e-1), shape))
            return (dt + np.log(-np.expm1(-dt))).astype(np.float32)
        if name.endswith("ssm_conv1d.weight"):
            return (rng.standard_normal(shape) / math.sqrt(hp.ssm_conv_kernel)).astype(np.float32)
        # ffn_gate_inp_shexp and any other float weight: std 1/sqrt(fan_in)
        fan_in = hp.n_embd if len(shape) == 1 else shape[-1]
        return (rng.standard_normal(shape) / math.sqrt(fan_in)).astype(np.float32)

    def _router(self, name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
        """[X, E]: random rows orthogonal to u (per-token logit noise ROUTER_NOISE) + a Zipf bias along u,
        in a random expert order per layer."""
        X, E = shape
        layer = int(name.split(".")[1])
        cos = expected_cos_u(self.hp, layer)
        rank = rng.permutation(X)  # rank[e] = popularity rank of expert e (0 = most popular)
        bias = -zipf_exponent(X, self.hp.n_expert_used) * np.log1p(rank) / (cos * math.sqrt(E))
        u = self.signs.astype(np.float64) / math.sqrt(E)
        z = rng.standard_normal((X, E))
        z -= np.outer(
            z @ u, u
        )  # no fixed per-expert offset from x's u share: popularity comes from bias only
        # x = rmsnorm output has norm sqrt(E), of which sqrt(1 - cos^2) lies off u
        z *= ROUTER_NOISE / (math.sqrt(E) * math.sqrt(1.0 - cos * cos))
        return (z + np.outer(bias, u)).astype(np.float32)


def build_writer(
    path, hp: HParams, expert_type: int, seed: int = 0, name: str = "strata-synth", dense_type: int = T.Q8_0,
    fused_gate_up: bool = False,
) -> ModelWriter:
    """fused_gate_up: each layer's gate and up experts as one ffn_gate_up_exps [X, 2I, E] (gate rows first),
    the same rows as the unfused file's (model-format.md's optional fused form)."""
    tok = byte_level_tokenizer_spec().padded(hp.n_vocab)
    mw = ModelWriter(path, hp, tok)
    mw.extra_fields["general.name"] = name
    model = SynthModel(hp, seed)
    gates: dict[str, tuple] = {}
    for tname, shape in tensor_layout(hp):
        t = synth_type(tname, shape, expert_type, dense_type)
        produce = model.producer(tname, shape, t)
        if fused_gate_up and tname.endswith(".ffn_gate_exps.weight"):
            gates[tname[: -len("gate_exps.weight")]] = (shape, t, produce)  # added with its up half
            continue
        if fused_gate_up and tname.endswith(".ffn_up_exps.weight"):
            prefix = tname[: -len("up_exps.weight")]
            g_shape, g_type, g_produce = gates.pop(prefix)
            if g_shape != shape or g_type != t:
                raise SynthError(f"{prefix}: gate and up experts differ ({g_shape}, {shape}): not fused")
            x, n_ff, n_in = shape
            mw.add(f"{prefix}gate_up_exps.weight", (x, 2 * n_ff, n_in), t,
                   lambda gp=g_produce, up=produce, x=x, n_ff=n_ff: _fused_rows(gp, up, x, n_ff))
            continue
        mw.add(tname, shape, t, produce)
    if gates:
        raise SynthError(f"gate experts without up experts to fuse with: {', '.join(sorted(gates))}")
    return mw


def _fused_rows(gate, up, x: int, n_ff: int) -> Iterator[np.ndarray]:
    """Producers of gate and up [X, I, ...] rows -> one expert's I gate rows then its I up rows at a time."""
    g = np.concatenate([np.asarray(c) for c in produced_chunks(gate())]).reshape(x, n_ff, -1)
    u = np.concatenate([np.asarray(c) for c in produced_chunks(up())]).reshape(x, n_ff, -1)
    for e in range(x):
        yield np.concatenate([g[e], u[e]])  # [2I, row]


def write_synth(
    path,
    arch: str | None,
    preset: str,
    layers: int | None = None,
    expert_type: str = "Q4_K",
    seed: int = 0,
    progress: bool = True,
    dense_type: str = "Q8_0",
    fused_gate_up: bool = False,
) -> HParams:
    """Write a synthetic model; returns its HParams. Raises SynthError (one line) on a bad request.
    fused_gate_up: gate and up experts as one ffn_gate_up_exps tensor a layer (build_writer)."""
    if expert_type not in EXPERT_TYPES:
        raise SynthError(f"unknown expert type {expert_type!r} (choose from {', '.join(EXPERT_TYPES)})")
    if dense_type not in DENSE_TYPES:
        raise SynthError(f"unknown dense type {dense_type!r} (choose from {', '.join(DENSE_TYPES)})")
    hp = preset_hparams(arch, preset, layers)
    if not str(path):
        raise SynthError("-o: an empty path; give the .gguf file to write")
    if str(path).endswith(("/", os.sep)):  # Path() drops the slash: a folder named as one became a file
        raise SynthError(f"-o {path}: names a folder; give the .gguf file to write")
    path = Path(path)
    if not path.parent.is_dir():
        raise SynthError(f"-o {path}: output directory {path.parent} does not exist")
    from strata_ray.atomic_file import regular_target

    try:  # the file the writer writes: a symbolic link's target, whose folder is checked and filled; a
        # folder, a device or a FIFO is refused here
        target = Path(regular_target(path))
    except OSError as e:
        why = "a loop of symbolic links" if e.errno == errno.ELOOP else "exists and is not a regular file"
        raise SynthError(f"-o {path}: {why}") from None
    if not target.parent.is_dir():
        raise SynthError(f"-o {path}: leads to {target}, whose folder does not exist")
    _check_writable(path, target.parent)
    mw = build_writer(path, hp, T[expert_type], seed, name=f"strata-synth-{hp.arch}-{preset}",
                      dense_type=T[dense_type], fused_gate_up=fused_gate_up)
    free = shutil.disk_usage(target.parent).free
    if mw.total_bytes > free:
        raise SynthError(f"not enough disk space: the model needs {_human_bytes(mw.total_bytes)}, "
                         f"{_human_bytes(free)} free")
    mw.write(progress=progress)
    return hp


def _check_writable(path: Path, folder: Path) -> None:
    """A file can be made in folder, where path's file is (a read-only or special folder, such as /proc,
    showed "not enough disk space: 0.0 GB free" instead)."""
    from strata_ray.atomic_file import probe_folder

    try:
        probe_folder(folder)  # the writer makes its .part file there, renamed over the file
    except OSError as e:
        raise SynthError(f"-o {path}: cannot write in {folder} ({e.strerror or e})") from None


def _is_gguf(path: Path) -> bool:
    """A GGUF file (False where it cannot be read)."""
    from strata_ray.config import starts_with
    from strata_ray.model.gguf_file import GGUF_MAGIC

    return starts_with(path, GGUF_MAGIC)


def _human_bytes(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


class _OneLineParser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)  # as config.OneLineArgumentParser

    def error(self, message: str):  # argparse prints usage + error; the CLI promises one line
        raise SynthError(message)


def _seed(s: str) -> int:
    """numpy's generators take seeds >= 0: a negative one is a bad flag, not a traceback (config.int_range's
    check and wording, as an argparse type)."""
    from strata_ray.config import int_range

    try:
        return int_range(0)(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"invalid value {s!r} (allowed: {e})") from None


def _layers(s: str) -> int:
    from strata_ray.config import decimal

    try:
        return decimal(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {s!r} (allowed: an integer >= 1)") from None


def _parser() -> argparse.ArgumentParser:
    p = _OneLineParser(
        prog="python -m strata_ray.run synth",
        description="Write a random-weight GGUF model at a preset shape.",
    )
    p.add_argument("--arch", choices=ARCHS,
                   help="qwen3next or qwen3moe (needed for tiny / small; implied by 30b-a3b / 80b-a3b)")
    p.add_argument(
        "--preset",
        required=True,
        choices=PRESETS,
        help="tiny / small (tests), 30b-a3b (qwen3moe real shape), 80b-a3b (qwen3next real shape)",
    )
    p.add_argument("--layers", type=_layers,
                   help="override the number of trunk layers, 1 to 1024 (the MTP layer is kept)")
    p.add_argument("--expert-type", default="Q4_K", choices=EXPERT_TYPES, help="routed experts' quant type")
    p.add_argument("--dense-type", default="Q8_0", choices=DENSE_TYPES,
                   help="the other matrices' quant type (Q4_K / Q6_K: a Q4_K_M file's; the embedding and MTP "
                        "projection stay Q8_0, rows not a multiple of 256 fall back to Q8_0)")
    p.add_argument("--seed", type=_seed, default=0, help="random seed >= 0 (same seed, same file)")
    p.add_argument("--fused-gate-up", action="store_true",
                   help="each layer's gate and up experts as one ffn_gate_up_exps tensor (the GGUF's "
                        "optional fused form; the same rows as without it)")
    p.add_argument("-o", "--output", required=True, help="output .gguf path (an existing file is refused)")
    p.add_argument("--force", action="store_true", help="overwrite an existing GGUF file at -o")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


@contextlib.contextmanager
def _terminate_as_interrupt():
    """SIGTERM and SIGHUP (`timeout`, a closed terminal, a CI job's end) raise KeyboardInterrupt while the
    file is written, so the writer removes its .part file as it does on Ctrl-C (they left all of it)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(_signum, _frame):
        raise KeyboardInterrupt

    # only where the default action (ending the process) stands: `nohup` sets SIGHUP to be ignored, and a
    # closed terminal must then not stop the write
    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)
                if signal.getsignal(sig) is signal.SIG_DFL}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def synth_main(argv: Sequence[str] | None = None) -> int:
    """CLI entry: exit 0 on success, 2 on a bad flag/request, 1 on an I/O failure (one line each)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except SynthError as e:
        print(f"strata_ray synth: {e}", file=sys.stderr)
        return 2
    exists = Path(args.output).is_file() and Path(args.output).stat().st_size > 0  # an empty one: `mktemp`'s
    gguf = exists and _is_gguf(Path(args.output))
    if exists and not (args.force and gguf):
        what = ("a GGUF file: --force overwrites it" if gguf
                else "not a GGUF file; remove it or give another path")
        print(f"strata_ray synth: -o {args.output}: exists and is {what}", file=sys.stderr)
        return 2
    try:
        with _terminate_as_interrupt():
            hp = write_synth(
                args.output,
                args.arch,
                args.preset,
                args.layers,
                args.expert_type,
                args.seed,
                progress=not args.no_progress,
                dense_type=args.dense_type,
                fused_gate_up=args.fused_gate_up,
            )
    except SynthError as e:
        print(f"strata_ray synth: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the writer removed its .part file on the way out
        print("strata_ray synth: interrupted", file=sys.stderr)
        return 130
    except (OSError, GGUFWriteError) as e:
        print(f"strata_ray synth: cannot write {args.output} ({getattr(e, 'strerror', None) or e})",
              file=sys.stderr)
        return 1
    size = Path(args.output).stat().st_size
    print(
        f"wrote {args.output}: {hp.arch}, {hp.n_layer} layer{'s' * (hp.n_layer != 1)} (+{hp.n_nextn} MTP), "
        f"{hp.n_expert} experts "
        f"{type_name(T[args.expert_type])}, {_human_bytes(size)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(synth_main())
