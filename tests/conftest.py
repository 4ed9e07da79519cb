"""Session-wide test setup that must happen before any test module imports triton."""

from tests.kernels.triton_interpret import INTERPRET  # noqa: F401  (sets TRITON_INTERPRET when it applies)
