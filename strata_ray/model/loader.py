"""Loading a model for inference: GGUF file -> hparams, float32 weights, reference Model, tokenizer.

`path=None` means the embedded default model that ships inside the package (strata_ray/data/).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from strata_ray.model.gguf_file import GGUFFile
from strata_ray.model.hparams import HParams, ModelFormatError

DEFAULT_MODEL_FILE = "strata-tiny-next.gguf"


def default_model_path() -> Path:
    """Where the embedded default model lives (it may be missing in a bare source checkout)."""
    return Path(__file__).resolve().parent.parent / "data" / DEFAULT_MODEL_FILE


def resolve_model_path(path: str | os.PathLike | None) -> Path:
    """The file to open: `path`, or the embedded default, which must exist (one-line error otherwise)."""
    if path is not None:
        return Path(path)
    default = default_model_path()
    if not default.is_file():
        raise ModelFormatError(
            f"the embedded default model is missing ({default}); reinstall strata-ray or pass --model PATH"
        )
    return default


@dataclass
class LoadedModel:
    file: GGUFFile
    hp: HParams
    model: object  # strata_ray.model.forward.Model
    tokenizer: object  # strata_ray.model.tokenizer.Tokenizer
    path: Path


def load_model(path: str | os.PathLike | None = None, device: str = "cpu") -> LoadedModel:
    """Open, check and load a GGUF for the reference forward. Raises ModelFormatError (one line)."""
    return load_model_file(GGUFFile(resolve_model_path(path)), device)


def load_model_file(file: GGUFFile, device: str = "cpu") -> LoadedModel:
    """`load_model` for a GGUFFile that is already open (its header is not parsed again)."""
    import torch

    from strata_ray.model.forward import Model
    from strata_ray.model.tokenizer import Tokenizer
    from strata_ray.model.weights import load_dense_weights

    tokenizer = Tokenizer.from_gguf(file)
    with torch.inference_mode():
        weights = load_dense_weights(file, device=device, include_experts=True)
    model = Model(file.hparams, weights)
    return LoadedModel(file=file, hp=file.hparams, model=model, tokenizer=tokenizer, path=file.path)
