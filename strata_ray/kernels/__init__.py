"""Expert kernels under the arithmetic contract (contract.py): numba CPU (expert_cpu), Triton GPU
(expert_gpu, imported on demand so CPU-only machines never need triton), numpy spec and reference."""

from .act_quant import quantize_act
from .contract import ExpertLayer, KernelError
from .expert_cpu import expert_ffn_cpu

__all__ = ["ExpertLayer", "KernelError", "expert_ffn_cpu", "quantize_act"]
