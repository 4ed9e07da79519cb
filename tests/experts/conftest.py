"""Tiny synthetic qwen3next GGUF files shared by the expert-tier tests (written once per session)."""

import pytest

from strata_ray.model.synth import write_synth


@pytest.fixture(scope="session")
def tiny_next(tmp_path_factory) -> str:
    """4 layers x 8 experts, the synth's default expert type."""
    path = tmp_path_factory.mktemp("tiny-next") / "tiny.gguf"
    write_synth(path, arch="qwen3next", preset="tiny", progress=False)
    return str(path)


@pytest.fixture(scope="session")
def tiny_next_q4(tmp_path_factory) -> str:
    """The same shape with Q4_0 experts (the type of the 80b-a3b benchmarks)."""
    path = tmp_path_factory.mktemp("tiny-next-q4") / "tiny.gguf"
    write_synth(path, arch="qwen3next", preset="tiny", expert_type="Q4_0", progress=False)
    return str(path)
