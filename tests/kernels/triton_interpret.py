"""Whether this test run executes the Triton kernels under Triton's CPU interpreter.

STRATA_TRITON_INTERPRET=1: yes, every interpreter test (the expert kernels' slow ones too, minutes);
=0: no. Unset: yes on a machine with triton and without a CUDA device (CI installs triton for this), so the
fused kernels' indexing, masks and sums are checked on every CPU run; a CUDA machine runs the same
kernels compiled instead (-m gpu).

TRITON_INTERPRET must be set before triton is first imported anywhere in the process: triton's own
library functions (tl.sum, tl.max, ...) are jitted at its import, and jitted for the compiler they fail
inside an interpreted kernel ("Cannot call @triton.jit'd outside of the scope of a kernel"; CI hit it when
another test module imported triton first). tests/conftest.py imports this module before any test module.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch


def _interpret() -> bool:
    flag = os.environ.get("STRATA_TRITON_INTERPRET")
    if flag is not None:
        return flag == "1"
    return importlib.util.find_spec("triton") is not None and not torch.cuda.is_available()


INTERPRET = _interpret()
if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"

interpret = pytest.mark.skipif(
    not INTERPRET, reason="Triton interpreter: needs triton and no CUDA device, or STRATA_TRITON_INTERPRET=1"
)
