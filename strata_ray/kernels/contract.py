"""The expert arithmetic contract: the written spec and the constants every implementation shares.

An expert's output row is bit-identical whichever device computes it (CPU pool, primary GPU, peer
GPU, streamed ring) and however many tokens share the expert in a launch. Every implementation
(numpy spec in `spec.py`, numba in `expert_cpu.py`, Triton in `expert_gpu.py`) performs exactly the
sequence of IEEE fp32 operations below, each rounded to nearest-even, no FMA contraction, no
reassociation, no split-K, no atomics. Integer sums are exact, so their order is free.

1. Activation quantization (per row, per block of QK = 32 values x[0..31]):
       amax = max_i |x[i]|                                      (exact)
       if amax < TINY (2^-60, this includes amax == 0): d = 0, q[i] = 0   (a zero block)
       else:
       d    = amax / 127            (fp32 division, correctly rounded)
       q[i] = rint(x[i] / d)        (fp32 division, then round-half-even; |q| <= 127)
       s    = sum_i q[i]            (int32, exact; used by the K-quant min term)
   A block holding a NaN or an infinity (a broken model's x, or h = silu(g) * u overflowing under
   extreme weights) is a poisoned block: d = NaN, q[i] = 0, s = 0. Every dot that reads it is then
   NaN (float(I) * (wd * NaN)), so its rows are NaN on every device, never finite and different per
   device (checked before the TINY rule: NaN and infinities are not < TINY). The TINY rule keeps every
   scale and product of the contract out of the subnormal range (d >= 2^-67, weight scale x d >=
   2^-91, partial sums 0 or >= 2^-114), so flush-to-zero settings cannot change a bit.
   rint(v) is computed as (v + RINT_MAGIC) - RINT_MAGIC with RINT_MAGIC = 1.5 * 2^23 (two rounded
   fp32 ops, exact round-half-even for |v| < 2^22, which holds for every use below), so no device
   needs a libm/libdevice rounding function.

2. Weight block dot (weights in GGUF block format, one output row, activation block b with scale
   ad = d_b above), contribution t_b, then acc = acc + t_b for b = 0, 1, 2, ... (acc starts at +0.0):
   float(I) is exact (|I| < 2^24). Products and sums below are single rounded fp32 operations,
   parenthesised as written.
   Q8_0 / Q4_0 (per 32-block: fp16 scale wd, ints w[i]):
       I   = sum_i w[i]*q[i]                                    (int32, exact)
       t_b = float(I) * (wd * ad)
   Q4_K (super-block of 256 = 8 sub-blocks of 32; fp16 d, dmin; 6-bit sc_j, m_j; w[i] in 0..15);
   activation block b is sub-block j = b % 8 of super-block b // 8:
       I   = sc_j * sum_i w[i]*q[i]       M = m_j * s_b           (int32, exact, |.| < 2^24)
       t_b = float(I) * (d * ad) - float(M) * (dmin * ad)
   Q6_K (super-block of 256 = 16 sub-blocks of 16; fp16 d; int8 sc_k; w[i] in -32..31);
   activation block b covers sub-blocks k0 = 2*(b % 8) and k0 + 1 of super-block b // 8:
       I   = sc_k0 * sum_{i<16} w[i]*q[i] + sc_k0+1 * sum_{i>=16} w[i]*q[i]   (int32, |.| < 2^24)
       t_b = float(I) * (d * ad)
   fp16 scales are converted to fp32 exactly.

3. Expert FFN for an entry (token t, expert e), x = the token's normed hidden vector [E]:
       (xq, xd, xs) = quantize(x)
       g[r] = dot(gate[e, r], x)          u[r] = dot(up[e, r], x)         r < n_ff
       h[r] = (g[r] / (1 + fexp(-g[r]))) * u[r]      (three rounded ops: add, div, mul)
       (hq, hd, hs) = quantize(h)
       row[c] = dot(down[e, c], h)        c < E

4. fexp(x), one fixed exp from elementary fp32 operations (no libm):
       x  = min(max(x, EXP_LO), EXP_HI)       (EXP_LO = -86 keeps the result normal)
       n  = rint(x * LOG2E)
       r  = (x - n * LN2_HI) - n * LN2_LO         (each product rounded, then each difference)
       p  = ((((((P6 * r + P5) * r + P4) * r + P3) * r + P2) * r + P1) * r + P0)   (Horner, mul then add)
       fexp = p * 2^n                 (2^n built from its exponent bits; exact, n in [-124, 127])

Float expert weights (F32/F16/BF16): no activation quantization; per 32-block
t_b = sum_i w[i]*x[i] (fp32, i increasing on CPU; a fixed tree on GPU), acc = acc + t_b; silu as
above. This path promises "same placement, same output" only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QK = 32  # activation block (values)
# GPU expert kernel variants (STRATA_KERNEL_VARIANT), all giving the same bits; the first is the default
KERNEL_VARIANTS = ("words", "simple", "wide", "split")
DECODE_MAX_TOKENS = 8  # a launch of at most this many tokens is a decode/verify window (GEMV-like tiles)


def pcie_entries(n_miss: int, share_permille: int) -> int:
    """How many of a decode layer's n_miss non-resident entries the GPU computes itself, reading their
    weights from the page-locked host store over PCIe: the this-many misses of the lowest expert ids; the
    CPU pool takes the rest. One integer rule that the device plan (decode_plan.decode_plan_pcie), the CPU
    worker (expert_cpu_token) and their tests all evaluate, so the two sides split a layer without talking.
    Expert order, not k order: a routing predicted from the layer's input holds mostly the same experts in
    another rank order, and with expert order it gives the CPU the same experts, which the worker reads
    ahead (STRATA_DECODE_WARM; with k order 60% of those reads were used, session 21).
    share_permille: 0-1000, the share of the misses, rounded half up. With experts copied ahead
    (STRATA_DECODE_PREFETCH) a miss whose expert is in the layer's staged list is the GPU's first, and
    n_miss counts the other misses only."""
    return (n_miss * share_permille + 500) // 1000


# GGML type ids (gguf.GGMLQuantizationType values), named by GGUF type name.
F32, F16, Q4_0, Q8_0, Q4_K, Q6_K, BF16 = 0, 1, 2, 8, 12, 14, 30
QUANT_TYPES = (Q8_0, Q4_0, Q4_K, Q6_K)
FLOAT_TYPES = (F32, F16, BF16)
TYPE_NAMES = {F32: "F32", F16: "F16", Q4_0: "Q4_0", Q8_0: "Q8_0", Q4_K: "Q4_K", Q6_K: "Q6_K",
              BF16: "BF16"}
# (elements, bytes) per weight block.
BLOCK = {F32: (1, 4), F16: (1, 2), BF16: (1, 2), Q8_0: (32, 34), Q4_0: (32, 18), Q4_K: (256, 144),
         Q6_K: (256, 210)}

TINY = np.float32(2.0 ** -60)  # activation blocks with amax below this quantize to zero
RINT_MAGIC = np.float32(12582912.0)  # 1.5 * 2^23: (v + M) - M == rint(v) for |v| < 2^22
Q_MAX = np.float32(127.0)

# fexp constants (fp32). LN2_HI has 9 trailing zero bits so n * LN2_HI is exact for |n| < 2^9.
EXP_LO = np.float32(-86.0)
EXP_HI = np.float32(88.0)
LOG2E = np.float32(1.44269504088896341)
LN2_HI = np.float32(0.693145751953125)
LN2_LO = np.float32(1.42860682030941723212e-06)
# Taylor coefficients 1/k! rounded to fp32; |r| <= ln2/2 gives relative error < 3e-7 from the
# polynomial, dwarfed by the activation quantization that follows.
EXP_POLY = tuple(np.float32(c) for c in (1.0, 1.0, 1 / 2, 1 / 6, 1 / 24, 1 / 120, 1 / 720))


class KernelError(ValueError):
    """A one-line user-facing error from the expert kernels (bad shapes, unsupported types)."""


def readonly_blocks(w) -> np.ndarray:
    """Block bytes as a read-only C-contiguous numpy array (a view when already contiguous). Read-only always,
    as the memory-mapped GGUF's are: numba compiles a kernel once per argument type, and writable weights
    would be a second compile of every kernel that reads them."""
    a = np.ascontiguousarray(np.asarray(w)).view()
    a.flags.writeable = False
    return a


def type_name(t: int) -> str:
    return TYPE_NAMES.get(t, f"type {t}")


def row_bytes(ggml_type: int, n: int) -> int:
    """Bytes of one weight row of n input values."""
    if ggml_type not in BLOCK:
        raise KernelError(f"expert kernels do not support weight type {type_name(ggml_type)}")
    elems, nbytes = BLOCK[ggml_type]
    if n % elems or n % QK:
        raise KernelError(f"row of {n} values is not a multiple of the {type_name(ggml_type)} block")
    return n // elems * nbytes


@dataclass(frozen=True)
class ExpertLayer:
    """One layer's routed experts in raw GGUF block bytes.

    gate/up: uint8 [X, n_ff, row_bytes(E)], down: uint8 [X, E, row_bytes(n_ff)]; X = experts (host)
    or cache slots (GPU: torch tensors on the device). Types are GGML type ids.
    """

    gate: object
    up: object
    down: object
    gate_type: int
    up_type: int
    down_type: int

    @property
    def n_embd(self) -> int:
        return int(self.down.shape[1])

    @property
    def n_ff(self) -> int:
        return int(self.gate.shape[1])

    def validate(self) -> None:
        """Raise KernelError (one line) unless shapes and byte widths match the types."""
        e, f = self.n_embd, self.n_ff
        for name, w, t, rows, n in (("ffn_gate_exps", self.gate, self.gate_type, f, e),
                                    ("ffn_up_exps", self.up, self.up_type, f, e),
                                    ("ffn_down_exps", self.down, self.down_type, e, f)):
            want = row_bytes(t, n)
            if len(w.shape) != 3 or int(w.shape[1]) != rows or int(w.shape[2]) != want:
                raise KernelError(f"{name}: shape {tuple(w.shape)} does not hold [X, {rows}, {want}] "
                                  f"bytes of {type_name(t)}")
        kinds = {self.gate_type in FLOAT_TYPES, self.up_type in FLOAT_TYPES, self.down_type in FLOAT_TYPES}
        if len(kinds) != 1:
            raise KernelError("an expert layer mixes float and quantized weight types")

    @property
    def c_contiguous(self) -> bool:
        """Whether gate, up and down are C-contiguous numpy arrays: what the CPU kernels read in place (a
        fused gate_up's halves and the CPU slot tier's views of its store are strided)."""
        return all(isinstance(w, np.ndarray) and w.flags.c_contiguous
                   for w in (self.gate, self.up, self.down))

    @property
    def is_float(self) -> bool:
        return self.gate_type in FLOAT_TYPES
