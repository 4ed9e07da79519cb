"""Writing llama.cpp-compatible GGUF files, streamed tensor by tensor so a 44 GB model never sits in memory.

Keys and names follow model-format §2 (arch keys, MTP/nextn) and §6 (tokenizer); gguf-py's GGUFWriter writes
the header, key/values and tensor infos, then this module writes each tensor's bytes itself, chunk by chunk.
"""

from __future__ import annotations

import os
import queue
import secrets
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from strata_ray.atomic_file import regular_target

from .hparams import HParams
from .quants import BLOCK, quantize, type_name
from .tokenizer import CHATML_TEMPLATE, CONTROL, NORMAL, UNUSED, byte_encoder

T = gguf.GGMLQuantizationType

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

DEFAULT_CHATML = CHATML_TEMPLATE  # the reader's fallback template, written out explicitly

# chunks the background writer may hold at once (one queued + one being written): a producer that reuses its
# buffers must rotate through IN_FLIGHT + 1 of them
IN_FLIGHT = 2

# llama.cpp refuses a gpt2 vocabulary without merges, so the plain byte-level vocab carries this one.
MINIMAL_MERGES = ("Ġ Ġ",)

# which llama "file type" a file is labelled with, from the type holding most of its bytes
_FILE_TYPE = {
    T.F32: gguf.LlamaFileType.ALL_F32,
    T.F16: gguf.LlamaFileType.MOSTLY_F16,
    T.BF16: gguf.LlamaFileType.MOSTLY_BF16,
    T.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
    T.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0,
    T.Q4_K: gguf.LlamaFileType.MOSTLY_Q4_K_M,
    T.Q6_K: gguf.LlamaFileType.MOSTLY_Q6_K,
}


class GGUFWriteError(Exception):
    """A tensor or key that cannot be written. The message is one line."""


# ------------------------------------------------------------------------------------------------ key/values


def hparams_fields(hp: HParams) -> dict[str, Any]:
    """The architecture key/values for hp, as python values (HParams.from_fields inverts this exactly)."""
    a = hp.arch
    f: dict[str, Any] = {
        "general.architecture": a,
        f"{a}.vocab_size": hp.n_vocab,
        f"{a}.context_length": hp.context_length,
        f"{a}.embedding_length": hp.n_embd,
        f"{a}.block_count": hp.block_count,  # includes the nextn (MTP) layers
        # dense FFN width: unused by these MoE graphs; real files carry the active expert width here
        f"{a}.feed_forward_length": hp.n_ff_exp * hp.n_expert_used,
        f"{a}.attention.head_count": hp.n_head,
        f"{a}.attention.head_count_kv": hp.n_head_kv,
        f"{a}.attention.key_length": hp.head_dim,
        f"{a}.attention.value_length": hp.head_dim,
        f"{a}.attention.layer_norm_rms_epsilon": hp.rms_eps,
        f"{a}.rope.freq_base": hp.rope_freq_base,
        f"{a}.rope.dimension_count": hp.n_rot,
        f"{a}.expert_count": hp.n_expert,
        f"{a}.expert_used_count": hp.n_expert_used,
        f"{a}.expert_feed_forward_length": hp.n_ff_exp,
    }
    if hp.n_ff_shexp:
        f[f"{a}.expert_shared_feed_forward_length"] = hp.n_ff_shexp
    if hp.n_nextn or a == "qwen3next":
        f[f"{a}.nextn_predict_layers"] = hp.n_nextn
    if a == "qwen3next":
        f.update(
            {
                f"{a}.ssm.conv_kernel": hp.ssm_conv_kernel,
                f"{a}.ssm.state_size": hp.ssm_d_state,
                f"{a}.ssm.group_count": hp.ssm_n_group,
                f"{a}.ssm.time_step_rank": hp.ssm_dt_rank,
                f"{a}.ssm.inner_size": hp.ssm_d_inner,
                f"{a}.full_attention_interval": _full_attention_interval(hp.recurrent),
                # authoritative over the interval; one entry per block, MTP blocks are attention (False)
                f"{a}.attention.recurrent_layers": [bool(r) for r in hp.recurrent] + [False] * hp.n_nextn,
            }
        )
    return f


def _full_attention_interval(recurrent: Sequence[bool]) -> int:
    """k such that layer i is full attention iff (i+1) % k == 0, if the pattern has one (else 4, unused)."""
    for k in range(1, len(recurrent) + 1):
        if all(r == ((i + 1) % k != 0) for i, r in enumerate(recurrent)):
            return k
    return 4


@dataclass
class TokenizerSpec:
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_id: int
    eos_id: int
    chat_template: str | None
    pre: str = "qwen2"
    pad_id: int | None = None

    def padded(self, n_vocab: int) -> TokenizerSpec:
        """Fill ids up to n_vocab with [PADi] UNUSED tokens, as the converter does for spare rows."""
        n = len(self.tokens)
        if n_vocab < n:
            raise GGUFWriteError(f"vocabulary of {n} tokens does not fit n_vocab={n_vocab}")
        extra = [f"[PAD{i}]" for i in range(n, n_vocab)]
        return replace(self, tokens=self.tokens + extra, token_types=self.token_types + [UNUSED] * len(extra))

    def token_id(self, text: str) -> int:
        return self.tokens.index(text)


def byte_level_tokenizer_spec(
    extra_merges: Iterable[str] = (), chat_template: str | None = DEFAULT_CHATML
) -> TokenizerSpec:
    """Ids 0..255 = the bytes (GPT-2 spelling), then one token per merge ("a b" -> "ab"), then the ChatML
    control tokens. bos = pad = <|endoftext|>, eos = <|im_end|> (as in Qwen3 instruct files)."""
    merges = list(extra_merges) or list(MINIMAL_MERGES)
    spelling = byte_encoder()  # GPT-2's byte -> printable character map (space -> 'Ġ')
    tokens = [spelling[b] for b in range(256)]
    known = set(tokens)
    for m in merges:
        left, sep, right = m.partition(" ")
        if not sep or left not in known or right not in known:
            raise GGUFWriteError(f"merge {m!r} must join two known tokens with one space")
        if left + right not in known:
            tokens.append(left + right)
            known.add(left + right)
    types = [NORMAL] * len(tokens)
    eot = len(tokens)
    tokens += list(SPECIAL_TOKENS)
    types += [CONTROL] * len(SPECIAL_TOKENS)
    return TokenizerSpec(
        tokens, types, merges, bos_id=eot, eos_id=eot + 2, chat_template=chat_template, pad_id=eot
    )


def tokenizer_fields(tok: TokenizerSpec) -> dict[str, Any]:
    f: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": tok.pre,
        "tokenizer.ggml.tokens": list(tok.tokens),
        "tokenizer.ggml.token_type": [int(t) for t in tok.token_types],  # ints -> INT32 array
        "tokenizer.ggml.merges": list(tok.merges),
        "tokenizer.ggml.bos_token_id": tok.bos_id,
        "tokenizer.ggml.eos_token_id": tok.eos_id,
        "tokenizer.ggml.add_bos_token": False,
    }
    if tok.pad_id is not None:
        f["tokenizer.ggml.padding_token_id"] = tok.pad_id
    if tok.chat_template:
        f["tokenizer.chat_template"] = tok.chat_template
    return f


def _add_field(w: gguf.GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, bool):  # before int: bool is an int
        w.add_bool(key, value)
    elif isinstance(value, (int, np.integer)):
        (w.add_uint32 if value >= 0 else w.add_int32)(key, int(value))
    elif isinstance(value, (float, np.floating)):
        w.add_float32(key, float(value))
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, (list, tuple)):
        if not value:
            raise GGUFWriteError(f"GGUF key {key} is an empty array (gguf-py would silently drop it)")
        w.add_array(key, list(value))  # element type from the first item: bool/int(INT32)/float/str
    else:
        raise GGUFWriteError(f"GGUF key {key} has unsupported value type {type(value).__name__}")


# ------------------------------------------------------------------------------------------------ tensors

Producer = Callable[[], "np.ndarray | Iterable[np.ndarray]"]


def produced_chunks(made) -> Iterable[np.ndarray]:
    """What a Producer made, as chunks of rows: one array is one chunk."""
    return [made] if isinstance(made, np.ndarray) else made


@dataclass
class _Entry:
    name: str
    shape: tuple[int, ...]
    ggml_type: int
    producer: Producer
    row_bytes: int = field(init=False)
    n_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        elems, size = BLOCK[self.ggml_type]
        row = self.shape[-1]
        if row % elems:
            raise GGUFWriteError(
                f"tensor {self.name}: row of {row} is not a multiple of the "
                f"{type_name(self.ggml_type)} block ({elems})"
            )
        self.row_bytes = row // elems * size
        self.n_bytes = int(np.prod(self.shape[:-1], dtype=np.int64)) * self.row_bytes


class ModelWriter:
    """Declare every tensor with add(), then write(): header, key/values, tensor infos, then each tensor's
    bytes in declaration order. A producer is called only when its tensor is written and returns float32
    values (quantized here) or raw uint8 blocks [..., row_bytes] — either one array of the full shape or an
    iterable of chunks along axis 0 (so one tensor need not be in memory at once)."""

    def __init__(
        self, path: str | os.PathLike, hp: HParams, tokenizer: TokenizerSpec, file_type: int | None = None
    ):
        if len(tokenizer.tokens) != hp.n_vocab:
            raise GGUFWriteError(
                f"tokenizer has {len(tokenizer.tokens)} tokens but the model has n_vocab={hp.n_vocab}"
            )
        self.path = Path(path)
        self.hp = hp
        self.tokenizer = tokenizer
        self.file_type = file_type
        self.extra_fields: dict[str, Any] = {}  # e.g. general.name
        self._entries: dict[str, _Entry] = {}

    def add(self, name: str, shape: tuple[int, ...], ggml_type: int, producer: Producer) -> None:
        if name in self._entries:
            raise GGUFWriteError(f"tensor {name} added twice")
        if int(ggml_type) not in BLOCK:
            raise GGUFWriteError(f"tensor {name}: type {type_name(ggml_type)} cannot be written")
        self._entries[name] = _Entry(name, tuple(int(s) for s in shape), int(ggml_type), producer)

    @property
    def total_bytes(self) -> int:
        return sum(e.n_bytes for e in self._entries.values())

    def fields(self) -> dict[str, Any]:
        """Every key/value the file will carry (general.architecture is written by gguf-py itself)."""
        f = hparams_fields(self.hp)
        f["general.quantization_version"] = gguf.GGML_QUANT_VERSION
        f["general.file_type"] = int(
            self.file_type if self.file_type is not None else self._guess_file_type()
        )
        f.update(tokenizer_fields(self.tokenizer))
        f.update(self.extra_fields)
        return f

    def _guess_file_type(self) -> int:
        per_type: dict[int, int] = {}
        for e in self._entries.values():
            per_type[e.ggml_type] = per_type.get(e.ggml_type, 0) + e.n_bytes
        main = max(per_type, key=per_type.get) if per_type else T.F32
        return _FILE_TYPE.get(T(main), gguf.LlamaFileType.GUESSED)

    def write(self, progress: bool = False) -> None:
        """Write the file (to .PATH.<random>.part, renamed on success so a failed run leaves no half file)."""
        try:  # a symbolic link is written through, to the file it leads to, as atomic_file writes (it was
            # replaced by the model, its target left as it was)
            target = Path(regular_target(self.path))
        except OSError:  # e.g. /dev/null: the rename would replace it
            raise GGUFWriteError(f"{self.path} exists and is not a regular file") from None
        # a name of this run's own, made here first (O_EXCL): a fixed PATH.part was overwritten and then
        # deleted whatever it was, and written through where it was a symbolic link
        tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.part")
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        w = bar = behind = None
        try:  # from the file's making on: an interrupt anywhere removes it (its random name is nobody's)
            w = gguf.GGUFWriter(tmp, self.hp.arch)
            for key, value in self.fields().items():
                if key != "general.architecture":
                    _add_field(w, key, value)
            for e in self._entries.values():
                w.add_tensor_info(e.name, e.shape, np.dtype(np.float32), e.n_bytes, raw_dtype=T(e.ggml_type))
            if progress:
                from tqdm import tqdm

                # disable=None: drawn only when stderr is a terminal (no bar garbage in logs and pipes)
                bar = tqdm(total=self.total_bytes, unit="B", unit_scale=True,
                           desc=f"writing {self.path.name}", disable=None)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            fout = w.fout[0]
            w.write_padding(fout, fout.tell())
            behind = _WriteBehind(fout)
            for e in self._entries.values():
                self._write_tensor(behind, e, bar)
                behind.put(bytes(-e.n_bytes % w.data_alignment))
            behind.finish()
            w.close()
            os.replace(tmp, target)
        except BaseException:
            if behind is not None:
                behind.stop()
            if w is not None:
                w.close()
            tmp.unlink(missing_ok=True)
            raise
        finally:
            if bar is not None:
                bar.close()

    def _write_tensor(self, behind: _WriteBehind, e: _Entry, bar) -> None:
        chunks = produced_chunks(e.producer())
        written = 0
        for chunk in chunks:
            blocks = self._as_blocks(e, np.asarray(chunk))
            if written + blocks.nbytes > e.n_bytes:
                break
            behind.put(memoryview(np.ascontiguousarray(blocks)).cast("B"))
            written += blocks.nbytes
            if bar is not None:
                bar.update(blocks.nbytes)
        if written != e.n_bytes:
            raise GGUFWriteError(
                f"tensor {e.name}: producer gave the wrong amount of data for shape {list(e.shape)}"
            )

    @staticmethod
    def _as_blocks(e: _Entry, a: np.ndarray) -> np.ndarray:
        """Chunk -> uint8 [..., row_bytes] blocks of the tensor's type."""
        if a.dtype == np.uint8:
            if a.shape[-1] != e.row_bytes:
                raise GGUFWriteError(
                    f"tensor {e.name}: raw rows of {a.shape[-1]} bytes, expected {e.row_bytes}"
                )
            return a
        if a.shape[-1] != e.shape[-1]:
            raise GGUFWriteError(f"tensor {e.name}: rows of {a.shape[-1]} values, expected {e.shape[-1]}")
        return quantize(a.astype(np.float32, copy=False), e.ggml_type)


class _WriteBehind:
    """Writes chunks on a background thread, so the next chunk is made while the kernel copies this one
    (file.write releases the GIL). Holds at most IN_FLIGHT chunks; the first write error is raised on the
    next put() or at finish()."""

    def __init__(self, fout):
        self._fout = fout
        self._queue: queue.Queue = queue.Queue(maxsize=IN_FLIGHT - 1)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="gguf-write-behind", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (chunk := self._queue.get()) is not None:
            if self._error is None:  # after an error keep draining, so put() never blocks forever
                try:
                    self._fout.write(chunk)
                except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                    self._error = e

    def put(self, chunk) -> None:
        if self._error is not None:
            raise self._error
        self._queue.put(chunk)

    def finish(self) -> None:
        """Wait until everything is written; raise the write error if there was one."""
        self.stop()
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join()


def write_model(
    path: str | os.PathLike,
    hp: HParams,
    tokenizer: TokenizerSpec,
    tensors: Mapping[str, tuple[int, np.ndarray]],
    progress: bool = False,
) -> None:
    """Convenience for small models: tensors = {name: (ggml_type, float32 or raw array)}."""
    mw = ModelWriter(path, hp, tokenizer)
    for name, (ggml_type, arr) in tensors.items():
        shape = (
            arr.shape if arr.dtype != np.uint8 else gguf.quant_shape_from_byte_shape(arr.shape, T(ggml_type))
        )
        mw.add(name, tuple(shape), ggml_type, lambda a=arr: a)
    mw.write(progress)
