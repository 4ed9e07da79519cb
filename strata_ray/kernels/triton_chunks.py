"""Triton device functions for the wide ("chunk") expert kernels: the same contract arithmetic as
triton_blocks.py (see contract.py), restructured so a program keeps many bytes in flight.

A chunk is NB consecutive 32-blocks of BR weight rows. It is loaded with 16-bit words in one go
(`load_chunk`), then decoded into pair tensors we/wo int32 [BR, NB, 16]: pair p of block b holds
the weights of elements 2p and 2p+1 (K-quant sub-block scales already multiplied in, as spec.py's
decode_int_blocks does). Every weight type thus meets the activations in one layout, the integer
block dots of all NB blocks come out of one reduction (integer sums are exact, so their order is
free), and only the fp32 terms are added one block at a time, in block order (`add_chunk_terms`).

Columns of a register tensor are picked with a masked integer sum over the block axis (one
non-zero term, exact); fp32 values travel through it as their bit patterns.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_blocks import T_Q4_0, T_Q4_K, T_Q6_K, T_Q8_0, i2f_small


@triton.jit
def i2f(i, T: tl.constexpr):
    """float(I) of a block dot: |I| < 2^22 for Q8_0/Q4_0/Q4_K, up to 2^24 for Q6_K."""
    if T == T_Q6_K:
        return i.to(tl.float32)
    else:
        return i2f_small(i)


@triton.jit
def f16_bits(h):
    """int tensor holding IEEE half bits (low 16 bits) -> f32 (exact)."""
    return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def pick(x, j: tl.constexpr):
    """Column j of int32 x [A, NB] -> [A] (exact: one non-zero term in the sum)."""
    return tl.sum(tl.where((tl.arange(0, x.shape[1]) == j)[None, :], x, 0), axis=1)


@triton.jit
def pick3(x, j: tl.constexpr):
    """x int32 [A, B, NB] -> [A, B], column j of the last axis (exact)."""
    return tl.sum(tl.where((tl.arange(0, x.shape[2]) == j)[None, None, :], x, 0), axis=2)


@triton.jit
def pick_f(x, j: tl.constexpr):
    """Column j of f32 x [A, NB], moved as bits (exact, sign of zero kept)."""
    return pick(x.to(tl.int32, bitcast=True), j).to(tl.float32, bitcast=True)


@triton.jit
def load_chunk(W, WH, base, b0, n_blocks, T: tl.constexpr, NB: tl.constexpr):
    """Raw words of blocks b0 .. b0+NB-1 of the rows at byte offsets base int64 [BR] (blocks past
    n_blocks read as zero). W: uint8 pointer, WH: the same bytes as int16.
    Returns (q1, q2 int16 [BR, NB, 16], s1..s5 [BR, NB]); unused ones are zero."""
    jj = b0 + tl.arange(0, NB)  # [NB] block index
    live = jj < n_blocks
    p = tl.arange(0, 16)[None, None, :]
    hb = (base // 2)[:, None]  # [BR, 1] row start in 16-bit words
    m3 = live[None, :, None]
    m2 = live[None, :]
    zero2 = tl.zeros((base.shape[0], NB), tl.int32)
    q2 = tl.zeros((base.shape[0], NB, 16), tl.int16)
    s2 = zero2
    s3 = zero2
    s4 = zero2
    s5 = zero2
    if T == T_Q8_0:  # 17 words: fp16 d, 16 words of two int8 codes
        wb = hb + (jj * 17)[None, :]
        q1 = tl.load(WH + wb[:, :, None] + 1 + p, mask=m3, other=0)
        s1 = tl.load(WH + wb, mask=m2, other=0).to(tl.int32)
    elif T == T_Q4_0:  # 9 words: fp16 d, 8 words; byte i holds elements i (low) and i + 16 (high)
        wb = hb + (jj * 9)[None, :]
        q1 = tl.load(WH + wb[:, :, None] + 1 + p % 8, mask=m3, other=0)
        s1 = tl.load(WH + wb, mask=m2, other=0).to(tl.int32)
    elif T == T_Q4_K:  # 72 words: d, dmin, 12 scale bytes, 4 groups of 32 bytes (sub-blocks 2g, 2g+1)
        j = jj % 8
        wb = hb + (jj // 8 * 72)[None, :]
        q1 = tl.load(WH + wb[:, :, None] + 8 + (16 * (j // 2))[None, :, None] + p, mask=m3, other=0)
        s1 = tl.load(WH + wb, mask=m2, other=0).to(tl.int32)
        s2 = tl.load(WH + wb + 1, mask=m2, other=0).to(tl.int32)
        bb = base[:, None] + (jj // 8 * 144 + 4)[None, :]  # scale bytes sc_b[0..11]
        s3 = tl.load(W + bb + j[None, :], mask=m2, other=0).to(tl.int32)  # sc_b[j]
        s4 = tl.load(W + bb + (j + 4)[None, :], mask=m2, other=0).to(tl.int32)  # sc_b[j + 4]
        s5 = tl.load(W + bb + ((j + 4) % 8)[None, :], mask=m2, other=0).to(tl.int32)  # sc_b[j - 4]
    else:  # Q6_K, 105 words: ql[128 bytes], qh[64 bytes], 16 int8 scales, fp16 d
        jb = jj % 8
        h = jb // 4
        r = jb % 4
        wb = hb + (jj // 8 * 105)[None, :]
        q1 = tl.load(WH + wb[:, :, None] + (32 * h + 16 * (r % 2))[None, :, None] + p, mask=m3, other=0)
        q2 = tl.load(WH + wb[:, :, None] + (64 + 16 * h)[None, :, None] + p, mask=m3, other=0)
        s1 = tl.load(WH + wb + 104, mask=m2, other=0).to(tl.int32)
        bb = base[:, None] + (jj // 8 * 210 + 192 + 2 * jb)[None, :]
        s2 = tl.load(W + bb, mask=m2, other=0).to(tl.int32)  # sc[2 jb] (unsigned byte)
        s3 = tl.load(W + bb + 1, mask=m2, other=0).to(tl.int32)  # sc[2 jb + 1]
    return q1, q2, s1, s2, s3, s4, s5


@triton.jit
def decode_chunk(q1, q2, s1, s2, s3, s4, s5, b0, T: tl.constexpr, NB: tl.constexpr):
    """Raw chunk words -> (we, wo int32 [BR, NB, 16] weights of elements 2p / 2p+1 with K-quant
    sub-block scales multiplied in, d f32 [BR, NB], dmin f32 [BR, NB], m int32 [BR, NB])."""
    jj = b0 + tl.arange(0, NB)
    p = tl.arange(0, 16)[None, None, :]
    u = q1.to(tl.int32) & 0xFFFF  # [BR, NB, 16] two bytes: element 2p low, 2p+1 high
    d = f16_bits(s1)
    dmin = tl.zeros(d.shape, tl.float32)
    m = tl.zeros(s1.shape, tl.int32)
    if T == T_Q8_0:
        v = q1.to(tl.int32)  # sign-extended word
        we = (v << 24) >> 24
        wo = v >> 8
    elif T == T_Q4_0:
        sh = 4 * (p // 8)  # pairs 8..15 are the high nibbles (elements 16..31)
        we = ((u >> sh) & 0xF) - 8
        wo = ((u >> (sh + 8)) & 0xF) - 8
    elif T == T_Q4_K:
        j = (jj % 8)[None, :]
        low = j < 4
        sc = tl.where(low, s3 & 63, (s4 & 0xF) | ((s5 >> 6) << 4))
        m = tl.where(low, s4 & 63, (s4 >> 4) | ((s3 >> 6) << 4))
        sh = (4 * (j % 2))[:, :, None]
        we = ((u >> sh) & 0xF) * sc[:, :, None]
        wo = ((u >> (sh + 8)) & 0xF) * sc[:, :, None]
        dmin = f16_bits(s2)
    else:  # Q6_K
        r = (jj % 4)[None, :, None]
        shl = 4 * (r // 2)
        shh = 2 * r
        uh = q2.to(tl.int32) & 0xFFFF
        sc = tl.where(p < 8, ((s2 << 24) >> 24)[:, :, None], ((s3 << 24) >> 24)[:, :, None])
        we = ((((u >> shl) & 0xF) | (((uh >> shh) & 3) << 4)) - 32) * sc
        wo = ((((u >> (shl + 8)) & 0xF) | (((uh >> (shh + 8)) & 3) << 4)) - 32) * sc
    return we, wo, d, dmin, m


@triton.jit
def chunk_int_dots(we, wo, AQ, arow, b0, K, valid, BT: tl.constexpr):
    """I int32 [BT, BR, NB]: exact block dots of the decoded chunk with the BT tile entries'
    activation rows arow int64 [BT] (int8 codes at AQ + arow * K; invalid entries give 0).
    One entry at a time keeps the product tile [BR, NB, 16] in registers."""
    col = (b0 + tl.arange(0, we.shape[1]))[:, None] * 32 + 2 * tl.arange(0, 16)[None, :]  # [NB, 16]
    tid = tl.arange(0, BT)[:, None, None]
    dots = tl.zeros((BT, we.shape[0], we.shape[1]), tl.int32)
    for t in tl.static_range(BT):
        a_row = tl.sum(tl.where(tl.arange(0, BT) == t, arow, 0))  # scalar
        ok = tl.sum(tl.where(tl.arange(0, BT) == t, valid.to(tl.int32), 0)) != 0
        lim = tl.where(ok, K, 0)  # nothing loads for an invalid entry
        ae = tl.load(AQ + a_row * K + col, mask=col < lim, other=0).to(tl.int32)
        ao = tl.load(AQ + a_row * K + col + 1, mask=col < lim, other=0).to(tl.int32)
        it = tl.sum(we * ae[None, :, :] + wo * ao[None, :, :], axis=2)  # [BR, NB]
        dots = dots + tl.where(tid == t, it[None, :, :], 0)
    return dots


@triton.jit
def add_chunk_terms(acc, dots, d, dmin, m, ad, asum, T: tl.constexpr):
    """acc f32 [BT, BR] += the chunk's block terms, block by block in increasing order (contract
    step 2). dots int32 [BT, BR, NB]; d, dmin f32 [BR, NB]; m int32 [BR, NB]; ad f32 [BT, NB];
    asum int32 [BT, NB]."""
    for j in tl.static_range(d.shape[1]):
        ad_j = pick_f(ad, j)[:, None]  # [BT, 1]
        t = i2f(pick3(dots, j), T) * (pick_f(d, j)[None, :] * ad_j)
        if T == T_Q4_K:
            msum = pick(m, j)[None, :] * pick(asum, j)[:, None]
            t = t - i2f_small(msum) * (pick_f(dmin, j)[None, :] * ad_j)
        acc = acc + t
    return acc


@triton.jit
def mm_chunked(acc1, acc2, W1, W1H, W2, W2H, base1, base2, AQ, AD, AS, arow, valid, K, n_blocks,
               T1: tl.constexpr, T2: tl.constexpr, GATED: tl.constexpr, BT: tl.constexpr,
               NB: tl.constexpr):
    """The decode main loop: chunk c + 1's weight words are loaded (into registers) before chunk
    c is computed, so two chunks per matrix are in flight while the fp32 terms are added in order."""
    a1, a2, a3, a4, a5, a6, a7 = load_chunk(W1, W1H, base1, 0, n_blocks, T1, NB)
    if GATED:
        c1, c2, c3, c4, c5, c6, c7 = load_chunk(W2, W2H, base2, 0, n_blocks, T2, NB)
    for b0 in range(0, n_blocks, NB):
        jj = b0 + tl.arange(0, NB)
        am = valid[:, None] & (jj < n_blocks)[None, :]
        aoff = arow[:, None] * n_blocks + jj[None, :]
        ad = tl.load(AD + aoff, mask=am, other=0.0)  # [BT, NB]
        asum = tl.load(AS + aoff, mask=am, other=0)
        n1, n2, n3, n4, n5, n6, n7 = load_chunk(W1, W1H, base1, b0 + NB, n_blocks, T1, NB)
        we, wo, d, dmin, m = decode_chunk(a1, a2, a3, a4, a5, a6, a7, b0, T1, NB)
        dots = chunk_int_dots(we, wo, AQ, arow, b0, K, valid, BT)
        acc1 = add_chunk_terms(acc1, dots, d, dmin, m, ad, asum, T1)
        a1, a2, a3, a4, a5, a6, a7 = n1, n2, n3, n4, n5, n6, n7
        if GATED:
            n1, n2, n3, n4, n5, n6, n7 = load_chunk(W2, W2H, base2, b0 + NB, n_blocks, T2, NB)
            we, wo, d, dmin, m = decode_chunk(c1, c2, c3, c4, c5, c6, c7, b0, T2, NB)
            dots = chunk_int_dots(we, wo, AQ, arow, b0, K, valid, BT)
            acc2 = add_chunk_terms(acc2, dots, d, dmin, m, ad, asum, T2)
            c1, c2, c3, c4, c5, c6, c7 = n1, n2, n3, n4, n5, n6, n7
    return acc1, acc2
