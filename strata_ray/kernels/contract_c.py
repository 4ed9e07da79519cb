"""The contract's SwiGLU (steps 3 and 4: the fixed exp) as C source, for the CUDA C kernels that fold the
SwiGLU into a launch of their own (expert_rows_cuda's SWIGLU form). It is act_quant.swiglu / fexp and
triton_blocks.swiglu / fexp operation for operation, every constant the contract's fp32 value written as its
bits, so with the compiler's contraction off (NVRTC --fmad=false; a host compiler's -ffp-contract=off) each
step is one rounded fp32 operation, as everywhere else. Only a NaN input goes its own way inside: the clamp
(fminf / fmaxf) takes it to EXP_LO where numpy's keeps it, so c_fexp(NaN) is finite; the SwiGLU of a NaN is a
NaN either way, and its block is poisoned all the same.

The same text compiles as host C++ (`host=True`: the division and the bit casts of the host), which is how
tests/kernels/test_contract_c.py holds it to the numpy twin (spec.swiglu_ref) without a GPU.
"""

from __future__ import annotations

import numpy as np

from .contract import EXP_HI, EXP_LO, EXP_POLY, LN2_HI, LN2_LO, LOG2E, Q_MAX, RINT_MAGIC, TINY


def _bits(v) -> str:
    return f"0x{int(np.float32(v).view(np.uint32)):08X}u"


# C_F32_MAX: |x| <= it is "finite" (a NaN compares false); C_TINY and C_Q_MAX: contract step 1's zero-block
# bound and code range, for the quantization the kernels run on the SwiGLU's values
_CONSTANTS = {"RINT_MAGIC": RINT_MAGIC, "EXP_LO": EXP_LO, "EXP_HI": EXP_HI, "LOG2E": LOG2E, "LN2_HI": LN2_HI,
              "LN2_LO": LN2_LO, **{f"P{i}": p for i, p in enumerate(EXP_POLY)}, "TINY": TINY, "Q_MAX": Q_MAX,
              "F32_MAX": np.finfo(np.float32).max}

_DEVICE_PRELUDE = r"""
#define CONTRACT_FN __device__ __forceinline__
CONTRACT_FN float c_bits(unsigned b) { return __uint_as_float(b); }
CONTRACT_FN float c_div(float a, float b) { return __fdiv_rn(a, b); }
"""

_HOST_PRELUDE = r"""
#include <cmath>
#include <cstring>
#define CONTRACT_FN static inline
CONTRACT_FN float c_bits(unsigned b) { float f; std::memcpy(&f, &b, 4); return f; }
CONTRACT_FN float c_div(float a, float b) { return a / b; }
using std::fmaxf;
using std::fminf;
"""

_BODY = r"""
CONTRACT_FN float c_rint(float v) { return (v + C_RINT_MAGIC) - C_RINT_MAGIC; }  // half-even, |v| < 2^22

// contract step 4: n = rint(x log2 e), r = (x - n LN2_HI) - n LN2_LO, Horner from P6 (mul, then add), p 2^n
CONTRACT_FN float c_fexp(float x) {
    x = fminf(fmaxf(x, C_EXP_LO), C_EXP_HI);
    const float n = c_rint(x * C_LOG2E);
    const float r = (x - n * C_LN2_HI) - n * C_LN2_LO;
    float p = r * C_P6 + C_P5;
    p = p * r + C_P4;
    p = p * r + C_P3;
    p = p * r + C_P2;
    p = p * r + C_P1;
    p = p * r + C_P0;
    return p * c_bits((unsigned)((int)n + 127) << 23);  // 2^n exact: n in [-124, 127]
}

// contract step 3: h = (g / (1 + fexp(-g))) * u
CONTRACT_FN float c_swiglu(float g, float u) { return c_div(g, 1.0f + c_fexp(-g)) * u; }
"""


# The block integers' float() for the CUDA C kernels, exact below 2^22 (every Q8_0 / Q4_0 / Q4_K block
# integer): an integer carried as i + I2F_BIAS holds 1.5 * 2^23 + i in a float's mantissa, so one subtraction
# gives float(i) and no I2F runs. i2f adds the bias itself; biased_f takes an integer the kernel biased where
# that is free (an MMA's accumulator input, the start of a dp4a chain).
I2F_SOURCE = r"""
#define I2F_BIAS 0x4B400000
__device__ __forceinline__ float biased_f(int c) { return __int_as_float(c) - 12582912.0f; }
__device__ __forceinline__ float i2f(int i) { return biased_f(i + I2F_BIAS); }
"""


# A GGUF block's f16 scale bits as the float they are, exactly (cvt.f32.f16; no cuda_fp16.h, so NVRTC needs
# no include path), for every CUDA C kernel that reads block scales
HALF_SOURCE = r"""
__device__ __forceinline__ float half_bits(unsigned bits) {
    float f;
    unsigned short h = (unsigned short)bits;
    asm("{ .reg .f16 t; mov.b16 t, %1; cvt.f32.f16 %0, t; }" : "=f"(f) : "h"(h));
    return f;
}
"""


def swiglu_source(host: bool = False) -> str:
    """c_rint, c_fexp and c_swiglu (float in, float out) with the contract's constants (C_TINY, C_Q_MAX and
    C_F32_MAX too, for the quantization around them), for NVRTC or (host) a host C++ compiler."""
    consts = "".join(f"#define C_{name} c_bits({_bits(v)})\n" for name, v in _CONSTANTS.items())
    return (_HOST_PRELUDE if host else _DEVICE_PRELUDE) + consts + _BODY
