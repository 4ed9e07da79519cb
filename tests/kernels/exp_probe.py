"""A Triton kernel that runs the GPU rows' fixed exp and SwiGLU over arrays, for their tests (a module of its
own: a jitted kernel resolves fexp and swiglu in its module's globals, and importing triton_blocks needs
triton, which a test module must not require to be collected)."""

from strata_ray.kernels.triton_blocks import fexp, swiglu, tl, triton


@triton.jit
def exp_swiglu_kernel(G, U, E, S, n, BLOCK: tl.constexpr):
    """E = fexp(G), S = swiglu(G, U), elementwise over n values."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0)
    u = tl.load(U + offs, mask=mask, other=0.0)
    tl.store(E + offs, fexp(g), mask=mask)
    tl.store(S + offs, swiglu(g, u), mask=mask)
