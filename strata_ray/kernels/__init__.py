"""Expert kernels under the arithmetic contract (contract.py): numba CPU (expert_cpu), Triton GPU
(expert_gpu, imported on demand so CPU-only machines never need triton), numpy spec and reference."""

from .numba_cache import guard

guard()  # before any cached kernel loads: a cache compiled from changed sources is dropped (numba_cache.py)

from .act_quant import quantize_act  # noqa: E402
from .contract import ExpertLayer, KernelError  # noqa: E402
from .expert_cpu import expert_ffn_cpu  # noqa: E402

__all__ = ["ExpertLayer", "KernelError", "expert_ffn_cpu", "quantize_act"]
