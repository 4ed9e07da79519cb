import numpy as np
import pytest

from strata_ray.model.gguf_file import GGUFFile
from strata_ray.model.routing_digest import DIGEST_BYTES, router_name, routing_digest
from strata_ray.model.synth import write_synth


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny synth models: (arch, seed, expert type) -> path. Seeds 0 and 1: one shape, other routers."""
    folder = tmp_path_factory.mktemp("digest")
    out = {}
    for arch, seed, etype in (("qwen3next", 0, "Q4_K"), ("qwen3next", 0, "Q8_0"), ("qwen3next", 1, "Q4_K"),
                              ("qwen3moe", 0, "Q4_K")):
        path = folder / f"{arch}-{seed}-{etype}.gguf"
        write_synth(path, arch=arch, preset="tiny", expert_type=etype, seed=seed, progress=False)
        out[arch, seed, etype] = path
    return out


def test_the_digest_is_the_routers_not_the_expert_quantization(models):
    """Another quantization of the same model keeps its routers (F32): the same identity, so a profile
    learned on one serves the other. Another seed (the same shape) or arch is another model."""
    digest = {key: routing_digest(GGUFFile(path)) for key, path in models.items()}
    assert all(len(d) == DIGEST_BYTES for d in digest.values())
    assert digest["qwen3next", 0, "Q4_K"] == digest["qwen3next", 0, "Q8_0"]
    assert digest["qwen3next", 0, "Q4_K"] != digest["qwen3next", 1, "Q4_K"]
    assert digest["qwen3next", 0, "Q4_K"] != digest["qwen3moe", 0, "Q4_K"]
    again = routing_digest(GGUFFile(models["qwen3next", 0, "Q4_K"]))
    assert again == digest["qwen3next", 0, "Q4_K"]  # stable


def test_a_change_in_the_last_routed_layer_changes_the_digest(models, tmp_path):
    """Both the first and the last router count: one value of the last one flipped is another model."""
    src = models["qwen3next", 0, "Q4_K"]
    file = GGUFFile(src)
    last = file.tensor(router_name(file.hparams.n_layer - 1))
    data = bytearray(src.read_bytes())
    data[last.file_offset] ^= 0x01
    changed = tmp_path / "changed.gguf"
    changed.write_bytes(bytes(data))
    assert routing_digest(GGUFFile(changed)) != routing_digest(file)
    assert np.asarray(GGUFFile(changed).tensor(router_name(0)).data).tobytes() == np.asarray(
        file.tensor(router_name(0)).data).tobytes()
