"""GQA attention of a few query tokens over the KV cache, without copying the cache (decode, verify).

The reference (ops.attention) repeats each kv head for its H / Hkv query heads (`repeat_interleave`): at 8K
tokens that copies the whole cache of the layer, ~2.2 ms a decode token over the 80b-a3b's 12 attention
layers on the H200 (session 5 trace). Here, split-K "flash decoding" with a fixed split:

- `_attn_partial_body`: one program per (token, kv head, split of `split` keys). It scores the kv head's
  rep query heads against its split's keys (one [REP, D] x [D, bk] product a key tile) and keeps an online
  softmax: the split's running max m, sum l and unnormalised output acc [REP, D].
- `_attn_combine_body`: one program per (token, query head, dc of its D values), its splits 16 at a time
  in increasing order: o = sum_s acc_s exp(m_s - M) / sum_s l_s exp(m_s - M), M the max of the m_s.

`split`, `bk` and `dc` (with the warps and pipeline stages) are the tiling, `AttnTiles`: TILES by default,
STRATA_ATTN_TILES to try others. Splits sit at fixed absolute key positions [s split, (s+1) split), and a
query reads only the keys it may see (causal: key j <= its position) and combines only its own splits. So a
token's output does not depend on how many tokens share the call (a decode step gives the bits of the same
token in a verify window), and the result is deterministic. Its sums run in other orders than the
reference's: the two agree to rounding.

The two products of a key tile run on the tensor cores as "tf32x3" (each float32 operand split into a TF32
high part and a TF32 low part, three MMAs: float32-like error, ~1e-6 relative). As float32 FMAs ("ieee")
Triton stages both operands through shared memory for every tile: under ncu the partial kernel sat at 86%
of L1 / shared-memory throughput, 10% of DRAM, one 150 KB program an SM. On the H200 (session 15,
scripts/bench_attention.py, graphed): 60.7 -> 34.8 us a layer at 8K keys, 250 -> 142 us at 32K; decode
with every expert resident at 8K 190-191 -> 203 tok/s. STRATA_ATTN_DOT=ieee keeps the float32 FMAs (other
bits, the same guarantees).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import Tensor

from .env_knob import env_knob
from .lazy_triton import jit_bodies
from .pdl import pdl_args
from .tile_plan import next_pow2


class AttnTiles(NamedTuple):
    """How the two kernels tile the work. split, bk and dc decide the arithmetic (the online softmax runs
    over bk-key tiles within each split-key split; the combine reduces dc values a program); warps set the
    layout of a tile's reductions, so they may change the bits too; stages only how fast. Every form is
    deterministic and gives a token the same bits alone or in a verify window.
    STRATA_ATTN_TILES=SPLITxBKxWARPSxSTAGESxDC (env only, read where a launch or a DeviceAttention is made)
    sets another form."""

    split: int  # keys a split covers: a (token, kv head) has ceil(keys / split) partial results to combine
    bk: int  # keys a program step scores (one [REP, D] x [D, bk] product)
    warps: int
    stages: int  # software pipelining of the key tiles' loads (1: none)
    dc: int  # a head's values a combine program writes (clamped to the head's D)

    def __str__(self) -> str:
        return "x".join(map(str, self))


def attn_tiles_value(raw: str) -> AttnTiles:
    """A value of STRATA_ATTN_TILES, e.g. 64x32x8x1x256 (ValueError naming what is allowed; config.py refuses
    a bad one with its one line when the engine starts)."""
    allowed = ("SPLITxBKxWARPSxSTAGESxDC: split, bk and dc powers of two with 16 <= bk <= split <= 1024 and "
               "16 <= dc <= 1024, warps 2, 4 or 8, stages 1 to 4")
    parts = raw.split("x")
    if len(parts) != 5 or not all(p.isascii() and p.isdigit() for p in parts):
        raise ValueError(allowed)
    t = AttnTiles(*map(int, parts))
    pow2 = all(v & (v - 1) == 0 for v in (t.split, t.bk, t.dc))
    if not (pow2 and 16 <= t.bk <= t.split <= 1024 and 16 <= t.dc <= 1024 and t.warps in (2, 4, 8)
            and 1 <= t.stages <= 4):
        raise ValueError(allowed)
    return t


# keys a partial program covers: split 256 gave 64 programs at 8K keys (2 kv heads), 90 us a call on the H200
# (latency-bound, 360 GB/s); 64 gives 256 programs. Of session 39's 51 tilings on the H100
# (scripts/bench_attention.py --tiles sweep, graphed, the 80b-a3b's heads) the least time at 1K + 8K keys:
# 64-key splits scored in one 64-key step, a head's values combined 64 a program (4 programs a head):
# 12.1 / 26.2 / 120.2 us at 1K / 8K / 32K keys. Before it, BEFORE_39 (Triton's default 3 stages; not timed
# itself): its 1-stage form took 14.9 / 35.8 / 166.3, and 3 stages moved the 64-value combine form by +0.8 /
# +1.3 / -19 us
TILES = AttnTiles(split=64, bk=64, warps=8, stages=1, dc=64)
BEFORE_39 = AttnTiles(split=64, bk=32, warps=8, stages=3, dc=256)  # the shipped form until session 39


def tiles_now() -> AttnTiles:
    """STRATA_ATTN_TILES if set (and not empty), else TILES; a bad value raises one line naming it."""
    return env_knob("STRATA_ATTN_TILES", attn_tiles_value, TILES)


tl = None  # triton.language, bound by lazy_triton.jit_bodies at the first launch


def _attn_partial_body(Q, K, V, M, L, ACC, POS, KVT, q_offset, n_keys, scale, H, Hkv, NS,
                       REP: tl.constexpr, REP_P: tl.constexpr, D: tl.constexpr, SPLIT_: tl.constexpr,
                       BK_: tl.constexpr, AT_DEVICE: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr):
    # Q f32 [T, H, D]; K, V f32 [S, Hkv, D]; M, L f32 [T, H, NS]; ACC f32 [T, H, NS, D]. Program (token x kv
    # head, p): splits p, p + P, ... (P programs on axis 1) that hold keys the token sees.
    # AT_DEVICE (a graph replays it at every position): the caches sit KVT[0] and KVT[1] floats from K (= V,
    # an anchor tensor: offsets from an argument keep the pointer's known 16-byte alignment), the first
    # token's position is POS[0] and n_keys = POS[0] + the argument (the tokens of the call).
    if PDL:  # it starts early, then waits for the kernel before (kernels/pdl.py)
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    if AT_DEVICE:
        q_offset = tl.load(POS)
        n_keys = q_offset + n_keys
        K = K + tl.multiple_of(tl.load(KVT), 16)
        V = V + tl.multiple_of(tl.load(KVT + 1), 16)
    pid = tl.program_id(0)
    t = pid // Hkv
    g = pid % Hkv
    heads = g * REP + tl.arange(0, REP_P)  # [REP_P] query heads of kv head g (padded rows: masked)
    live_h = tl.arange(0, REP_P) < REP
    d = tl.arange(0, D)
    q = tl.load(Q + (t * H + heads)[:, None].to(tl.int64) * D + d[None, :], mask=live_h[:, None], other=0.0)
    visible = tl.minimum(q_offset + t + 1, n_keys)  # keys 0 .. visible-1 (causal)
    for s in range(tl.program_id(1), (visible + SPLIT_ - 1) // SPLIT_, tl.num_programs(1)):
        k0 = s * SPLIT_
        m_i = tl.full((REP_P,), float("-inf"), tl.float32)
        l_i = tl.zeros((REP_P,), tl.float32)
        acc = tl.zeros((REP_P, D), tl.float32)
        for kt in range(k0, tl.minimum(k0 + SPLIT_, visible), BK_):
            j = kt + tl.arange(0, BK_)  # [BK]
            live_k = j < tl.minimum(k0 + SPLIT_, visible)
            kv_off = (j[:, None].to(tl.int64) * Hkv + g) * D + d[None, :]  # [BK, D]
            kb = tl.load(K + kv_off, mask=live_k[:, None], other=0.0)
            vb = tl.load(V + kv_off, mask=live_k[:, None], other=0.0)  # with k: one memory wait a tile
            sc = tl.dot(q, tl.trans(kb), input_precision=PREC) * scale  # [REP_P, BK]
            sc = tl.where(live_k[None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))  # finite: every tile has a live key
            p = tl.exp(sc - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p, vb, input_precision=PREC)
            m_i = m_new
        row = (t * H + heads).to(tl.int64) * NS + s  # [REP_P]
        tl.store(M + row, m_i, mask=live_h)
        tl.store(L + row, l_i, mask=live_h)
        tl.store(ACC + row[:, None] * D + d[None, :], acc, mask=live_h[:, None])


def _attn_combine_body(M, L, ACC, O, POS, q_offset, n_keys, H, NS, D: tl.constexpr, SPLIT_: tl.constexpr,
                       SC: tl.constexpr, DC: tl.constexpr, AT_DEVICE: tl.constexpr, PDL: tl.constexpr):
    # One program per (token, query head, DC of its D values): its own splits, SC at a time in increasing
    # order, each chunk added lane by lane to [SC] / [SC, DC] accumulators reduced once at the end; splits
    # past the query's keys are masked to exact zeros, so a decode step and a verify window give the same
    # bits. Each program of a head computes the head's max and sum alike (the same bits); a head's D values
    # in chunks put more programs on the splits' reads (16 heads a token: 16 programs reading 128 KiB each
    # at 8K keys, 64-key splits).
    if PDL:  # it starts early, then waits for the kernel before (kernels/pdl.py)
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    if AT_DEVICE:  # as in the partial kernel
        q_offset = tl.load(POS)
        n_keys = q_offset + n_keys
    pid = tl.program_id(0)
    t = pid // H
    visible = tl.minimum(q_offset + t + 1, n_keys)
    n_split = (visible + SPLIT_ - 1) // SPLIT_
    base = pid.to(tl.int64) * NS
    d = tl.program_id(1) * DC + tl.arange(0, DC)
    sc = tl.arange(0, SC)
    m_lane = tl.full((SC,), float("-inf"), tl.float32)
    for s0 in range(0, n_split, SC):
        m_lane = tl.maximum(m_lane, tl.load(M + base + s0 + sc, mask=s0 + sc < n_split, other=float("-inf")))
    m = tl.max(m_lane, axis=0)
    l_lane = tl.zeros((SC,), tl.float32)
    o_lane = tl.zeros((SC, DC), tl.float32)
    for s0 in range(0, n_split, SC):
        live = s0 + sc < n_split
        w = tl.exp(tl.load(M + base + s0 + sc, mask=live, other=float("-inf")) - m)  # [SC], 0 past the end
        l_lane += tl.load(L + base + s0 + sc, mask=live, other=0.0) * w
        o_lane += tl.load(ACC + (base + s0 + sc)[:, None] * D + d[None, :], mask=live[:, None], other=0.0) \
            * w[:, None]
    tl.store(O + pid.to(tl.int64) * D + d, tl.sum(o_lane, axis=0) / tl.sum(l_lane, axis=0))


def _kv_append_body(ANCHOR, KVT, POS, KN, VN, ROW, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # KVT int64 [2]: the K and V caches (f32 [S, Hkv, D]) as offsets in floats from ANCHOR; KN, VN f32
    # [T, ROW] the new rows, written at positions POS[0] + t. Program t.
    if PDL:  # it starts early, then waits for the kernel before (kernels/pdl.py)
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(0)
    at = (tl.load(POS) + t) * ROW
    kc = ANCHOR + tl.multiple_of(tl.load(KVT), 16)
    vc = ANCHOR + tl.multiple_of(tl.load(KVT + 1), 16)
    for c in range(0, ROW, BLOCK):
        i = c + tl.arange(0, BLOCK)
        live = i < ROW
        tl.store(kc + at + i, tl.load(KN + t * ROW + i, mask=live), mask=live)
        tl.store(vc + at + i, tl.load(VN + t * ROW + i, mask=live), mask=live)


def _dot_precision() -> str:
    """The key tiles' products (module docstring): STRATA_ATTN_DOT, "tf32x3" (the default) or "ieee" (the
    config refuses other values; read at each launch, so a graph keeps the form it was captured with)."""
    return env_knob("STRATA_ATTN_DOT", _dot_value, "tf32x3")


def _dot_value(raw: str) -> str:
    if raw not in ("tf32x3", "ieee"):
        raise ValueError("tf32x3 or ieee")
    return raw


@functools.cache
def _kernels():
    # the runtime sizes unspecialized: a new cache length never compiles a new binary
    return jit_bodies(_attn_partial_body, _attn_combine_body, _kv_append_body,
                      do_not_specialize=["q_offset", "n_keys", "NS"])


def attention_decode_supports(q: Tensor, k: Tensor) -> bool:
    """Shapes the kernels take: query heads a multiple of kv heads, head size a power of two >= 16."""
    D = q.shape[-1]
    return q.shape[1] % k.shape[1] == 0 and D >= 16 and D & (D - 1) == 0


def attention_decode(q: Tensor, k: Tensor, v: Tensor, q_offset: int, scale: float) -> Tensor:
    """ops.attention for a few queries: q [T, H, D] at positions q_offset.., k, v [S, Hkv, D] (S >= q_offset
    + T: the cache including these tokens) -> [T, H, D] float32."""
    T, H, D = q.shape
    S, Hkv, _ = k.shape
    if q.dtype != torch.float32 or k.dtype != torch.float32 or v.dtype != torch.float32:
        raise ValueError(f"attention_decode needs float32 q, k, v, got {q.dtype} {k.dtype} {v.dtype}")
    if not attention_decode_supports(q, k) or S < q_offset + T or v.shape != k.shape:
        raise ValueError(f"attention_decode: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} at "
                         f"offset {q_offset} (H a multiple of Hkv, D a power of two >= 16, S >= offset + T)")
    out = torch.empty((T, H, D), dtype=torch.float32, device=q.device)
    if T == 0:
        return out
    tiles = tiles_now()
    ns = -(-S // tiles.split)
    m = torch.empty((T, H, ns), dtype=torch.float32, device=q.device)
    scratch = (m, torch.empty_like(m), torch.empty((T, H, ns, D), dtype=torch.float32, device=q.device))
    _launch(q, k.contiguous(), v.contiguous(), scratch, out, None, None, q_offset, S, scale, Hkv, ns, tiles)
    return out


def _launch(q: Tensor, k: Tensor, v: Tensor, scratch: tuple[Tensor, Tensor, Tensor], out: Tensor,
            pos: Tensor | None, table: Tensor | None, q_offset: int, n_keys: int, scale: float, Hkv: int,
            programs: int, tiles: AttnTiles) -> None:
    """The partial then the combine kernel over q [T, H, D] into out, scratch = (m, l, acc) of NS splits of
    tiles.split keys.
    pos None: the keys of k, v up to q_offset + T (n_keys of them), a program a split; else (AT_DEVICE) the
    position in pos, the caches table's offsets from k (= v), n_keys the call's tokens, `programs` programs a
    (token, kv head) walking the splits."""
    T, H, D = q.shape
    m, ell, acc = scratch
    ns = m.shape[-1]
    at_device = pos is not None
    cell = pos if at_device else m  # an unused pointer argument without AT_DEVICE
    partial, combine, _ = _kernels()
    partial[(T * Hkv, programs)](q.contiguous(), k, v, m, ell, acc, cell, table if at_device else m, q_offset,
                                 n_keys, scale, H, Hkv, ns, REP=H // Hkv, REP_P=max(16, next_pow2(H // Hkv)),
                                 D=D, SPLIT_=tiles.split, BK_=tiles.bk, AT_DEVICE=at_device,
                                 PREC=_dot_precision(), num_warps=tiles.warps, num_stages=tiles.stages,
                                 **pdl_args(m))
    dc = min(tiles.dc, D)
    combine[(T * H, D // dc)](m, ell, acc, out, cell, q_offset, n_keys, H, ns, D=D, SPLIT_=tiles.split,
                              SC=16, DC=dc, AT_DEVICE=at_device, num_warps=4, **pdl_args(m))


class DeviceAttention:
    """attention_decode for a CUDA graph replayed at every position: the cache grows, the graph does not.

    The kernels take the first token's position from a device cell (pos, int64 [1]) and the K and V caches
    from a table (int64 [2], written by the host when a cache moves), so one captured launch serves every
    step. The table holds each cache's offset in floats from this object's anchor tensor (`table_row`), not
    its address, so the kernels' pointers keep the alignment Triton knows of an argument (vector loads, as
    from the caches passed in). The partial kernel's grid is fixed: `programs` programs a (token, kv head)
    walk the splits the tokens see, each split computed as attention_decode computes it (the same body), and
    the scratch holds the splits of max_keys keys. The bits are attention_decode's at the same position
    under the same tiling and products (STRATA_ATTN_TILES is read once, here; STRATA_ATTN_DOT at a launch).

    In the decode graphs with STRATA_DECODE_DEVICE_ATTENTION=1, the default in the token graphs only: on the
    H200 its kernels ran as fast as attention_decode's (scripts/bench_attention.py), but the per-layer
    graphs' decode with it was slower (session 12); in the token graphs, where it makes a token one graph,
    the budget decode was faster (79.0-80.6 -> 87.0 tok/s at 8K, session 20)."""

    def __init__(self, n_head: int, n_head_kv: int, head_dim: int, max_keys: int, device: torch.device,
                 n_tok: int = 1, programs: int = 256):
        self.shape = (n_head, n_head_kv, head_dim)
        self.n_tok, self.max_keys = n_tok, max_keys
        self.tiles = tiles_now()  # fixed for the object's life: its scratch and a captured graph's launch
        self.ns = -(-max_keys // self.tiles.split)  # splits the scratch holds
        self.programs = min(self.ns, programs)
        f32 = dict(dtype=torch.float32, device=device)
        self.m = torch.empty((n_tok, n_head, self.ns), **f32)  # [T, H, NS]
        self.ell = torch.empty_like(self.m)
        self.acc = torch.empty((n_tok, n_head, self.ns, head_dim), **f32)  # [T, H, NS, D]
        self.out = torch.empty((n_tok, n_head, head_dim), **f32)  # [T, H, D]
        self.anchor = self.out  # the caches' offsets are counted from here

    def table_row(self, keys: Tensor, values: Tensor) -> tuple[int, int]:
        """A layer's table row: its caches (float32, on this device, 64-byte aligned) as offsets in floats
        from the anchor."""
        base = self.anchor.data_ptr()
        for c in (keys, values):
            if c.dtype != torch.float32 or c.device != self.anchor.device or (c.data_ptr() - base) % 64:
                raise ValueError(f"DeviceAttention: a cache must be float32 on {self.anchor.device}, 64-byte "
                                 f"aligned; got {c.dtype} on {c.device}")
        return (keys.data_ptr() - base) // 4, (values.data_ptr() - base) // 4

    def append(self, table: Tensor, pos: Tensor, k: Tensor, v: Tensor) -> None:
        """Write k, v [T, Hkv, D] into the caches of `table` (int64 [2], table_row's), at positions pos[0]..
        pos[0] + T - 1."""
        T, Hkv, D = k.shape
        row = Hkv * D
        _, _, append = _kernels()
        append[(T,)](self.anchor, table, pos, k.contiguous(), v.contiguous(), row,
                     BLOCK=min(1024, next_pow2(row)), num_warps=4, **pdl_args(table))

    def __call__(self, q: Tensor, table: Tensor, pos: Tensor, scale: float) -> Tensor:
        """Attention of q [T, H, D] at positions pos[0].. over the caches in `table` (keys 0 .. pos[0] + T
        - 1, written before) -> this object's output buffer [T, H, D]."""
        H, Hkv, D = self.shape
        if tuple(q.shape) != (self.n_tok, H, D) or q.dtype != torch.float32:
            raise ValueError(f"DeviceAttention: q must be float32 {[self.n_tok, H, D]}, got {q.dtype} "
                             f"{list(q.shape)}")
        a = self.anchor
        _launch(q, a, a, (self.m, self.ell, self.acc), self.out, pos, table, 0, q.shape[0], scale, Hkv,
                self.programs, self.tiles)
        return self.out
