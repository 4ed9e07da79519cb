"""The contract's SwiGLU as C source (strata_ray/kernels/contract_c.py): compiled by the host's C++ compiler
with contraction off, its bits against the numpy twin (spec.swiglu_ref) over values of every magnitude the
activations take, the exp's clamps and zeros included. The CUDA C kernels compile the same text (NVRTC,
--fmad=false); -m gpu tests hold their rows to the CPU's."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from strata_ray.kernels.contract_c import swiglu_source
from strata_ray.kernels.spec import fexp_ref, swiglu_ref

MAIN = r"""
#include <cstdio>
#include <vector>
int main() {  // stdin: n, then n (g, u) float pairs; stdout: n (fexp(g), swiglu(g, u)) pairs
    unsigned n;
    if (std::fread(&n, 4, 1, stdin) != 1) return 1;
    std::vector<float> io(2 * (size_t)n);
    if (std::fread(io.data(), 4, io.size(), stdin) != io.size()) return 1;
    for (size_t i = 0; i < n; ++i) {
        const float g = io[2 * i], u = io[2 * i + 1];
        io[2 * i] = c_fexp(g);
        io[2 * i + 1] = c_swiglu(g, u);
    }
    std::fwrite(io.data(), 4, io.size(), stdout);
    return 0;
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a host C++ compiler")
def test_the_c_swiglu_is_the_contracts_bit_for_bit(tmp_path):
    src, exe = tmp_path / "swiglu.cpp", tmp_path / "swiglu"
    src.write_text(swiglu_source(host=True) + MAIN)
    cmd = ["g++", "-O2", "-ffp-contract=off", "-fno-fast-math", "-o", str(exe), str(src)]
    subprocess.run(cmd, check=True)
    rng = np.random.default_rng(0)
    n = 200_000
    g = (rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 2.3, n)).astype(np.float32)
    edges = np.array([0.0, -0.0, 1e-30, -1e-30, 86.0, -86.0, 87.9, -88.0, 88.0, 88.5, -90.0, 150.0, -150.0,
                      0.5, -0.5, 3.4e38, -3.4e38, np.inf, -np.inf, np.nan], np.float32)
    g = np.concatenate([edges, g])
    u = rng.standard_normal(g.size).astype(np.float32)
    u[: edges.size] = 1.0
    inp = np.empty(2 * g.size, np.float32)
    inp[0::2], inp[1::2] = g, u
    out = subprocess.run([str(exe)], input=np.uint32(g.size).tobytes() + inp.tobytes(), capture_output=True,
                         check=True).stdout
    got = np.frombuffer(out, np.float32).reshape(-1, 2)
    with np.errstate(over="ignore", invalid="ignore"):
        want_exp, want = fexp_ref(g), swiglu_ref(g, u)
    # a NaN's exp: C's clamp (fmaxf) takes it to EXP_LO, numpy's keeps it (contract_c); its SwiGLU is a NaN
    # in both, whose payload bits are the host's own
    number = ~np.isnan(g)
    assert np.array_equal(got[number, 0].view(np.int32), want_exp[number].view(np.int32))
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got[:, 1]), nan) and nan[np.isnan(g)].all()
    assert np.isinf(want[g == np.inf]).all()  # an infinite gate's SwiGLU: an infinity, the same bits below
    assert np.array_equal(got[~nan, 1].view(np.int32), want[~nan].view(np.int32))
