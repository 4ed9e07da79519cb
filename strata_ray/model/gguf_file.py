"""Read a GGUF model (one file or split shards): metadata as python values, tensors as zero-copy memmap views.

The header is parsed here with `struct` rather than through `gguf.GGUFReader`: the reader builds one numpy
view per array element while it parses, which takes seconds for a Qwen vocabulary (152k tokens + 151k
merges). The layout is GGUF v2/v3, little-endian (ggml `docs/gguf.md`); block sizes come from
`gguf.GGML_QUANT_SIZES`.
Tensor data is mapped copy-on-write (mmap ACCESS_COPY): arrays are writable for torch.from_numpy (no warning)
and still share pages with the file; nothing is ever written back.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from strata_ray.model.hparams import HParams, ModelFormatError
from strata_ray.model.tensor_layout import check_tensors

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
SHARD_NAME = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

# scalar value types -> (struct format, numpy dtype)
_SCALARS: dict[int, tuple[str, np.dtype]] = {
    GGUFValueType.UINT8: ("<B", np.dtype("<u1")),
    GGUFValueType.INT8: ("<b", np.dtype("<i1")),
    GGUFValueType.UINT16: ("<H", np.dtype("<u2")),
    GGUFValueType.INT16: ("<h", np.dtype("<i2")),
    GGUFValueType.UINT32: ("<I", np.dtype("<u4")),
    GGUFValueType.INT32: ("<i", np.dtype("<i4")),
    GGUFValueType.FLOAT32: ("<f", np.dtype("<f4")),
    GGUFValueType.BOOL: ("<?", np.dtype("?")),
    GGUFValueType.UINT64: ("<Q", np.dtype("<u8")),
    GGUFValueType.INT64: ("<q", np.dtype("<i8")),
    GGUFValueType.FLOAT64: ("<d", np.dtype("<f8")),
}
# ggml types the reader hands out as typed arrays; every other type (quants, BF16) is uint8 [..., row_bytes]
_TYPED = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: int
    shape: tuple[int, ...]  # numpy order (reversed ggml ne)
    data: np.ndarray = field(
        repr=False
    )  # zero-copy view; uint8 [..., row_bytes] for quant/BF16, typed for F32/F16
    n_bytes: int
    path: str = ""  # shard holding the data
    file_offset: int = 0  # absolute byte offset of the data in that shard (for direct/pinned reads)


class _Corrupt(Exception):
    """Internal: a structural problem; turned into one ModelFormatError line naming the file."""


class _Cursor:
    """Sequential little-endian reads over a mapped file; every overrun is a _Corrupt."""

    def __init__(self, buf: mmap.mmap, offset: int = 0):
        self.buf, self.pos, self.size = buf, offset, len(buf)

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise _Corrupt(f"{what} at byte {self.pos} runs past the end of the {self.size}-byte file")

    def scalar(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def u32(self, what: str) -> int:
        return self.scalar("<I", what)

    def u64(self, what: str) -> int:
        return self.scalar("<Q", what)

    def string(self, what: str) -> str:
        n = self.u64(f"{what} length")
        self.need(n, what)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _Corrupt(f"{what} is not UTF-8") from e

    def value(self, vtype: int, key: str):
        if vtype == GGUFValueType.STRING:
            return self.string(f"value of {key}")
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype][0], f"value of {key}")
        if vtype == GGUFValueType.ARRAY:
            return self.array(key)
        raise _Corrupt(f"key {key} has unknown value type {vtype}")

    def array(self, key: str) -> list:
        etype = self.u32(f"array type of {key}")
        count = self.u64(f"array length of {key}")
        if etype in _SCALARS:  # numeric arrays in one slice (token_type has ~152k entries)
            dtype = _SCALARS[etype][1]
            self.need(count * dtype.itemsize, f"array {key}")
            arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
            self.pos += count * dtype.itemsize
            return arr.tolist()
        if etype == GGUFValueType.STRING:  # a tight loop: tokens/merges are ~150k strings each
            self.need(count * 8, f"array {key}")  # at least the length prefixes
            buf, pos, size, out = self.buf, self.pos, self.size, []
            unpack = struct.Struct("<Q").unpack_from
            try:
                for _ in range(count):
                    (n,) = unpack(buf, pos)
                    pos += 8
                    if pos + n > size:
                        raise _Corrupt(f"string in array {key} runs past the end of the file")
                    out.append(buf[pos : pos + n].decode("utf-8"))
                    pos += n
            except struct.error as e:
                raise _Corrupt(f"array {key} runs past the end of the file") from e
            except UnicodeDecodeError as e:
                raise _Corrupt(f"string in array {key} is not UTF-8") from e
            self.pos = pos
            return out
        if etype == GGUFValueType.ARRAY:
            return [self.array(key) for _ in range(count)]
        raise _Corrupt(f"array {key} has unknown element type {etype}")


def _map(path: Path) -> mmap.mmap:
    """Map the whole file copy-on-write; raises ModelFormatError for missing / unreadable / non-GGUF files."""
    try:  # a file without read permission, or one whose reads fail (EIO), was a traceback
        if not path.exists():
            raise ModelFormatError(f"model file not found: {path}")
        if not path.is_file():
            what = "a folder" if path.is_dir() else "not a regular file"
            raise ModelFormatError(f"model file {path} is {what}; give a .gguf file")
        with open(path, "rb") as f:
            if f.read(4) != GGUF_MAGIC:
                raise ModelFormatError(f"not a GGUF file: {path}")
            try:
                return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            except OSError:  # strict overcommit can refuse a private writable map of a huge file: read-only
                return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise ModelFormatError(f"cannot read model file {path} ({e.strerror or e})") from None


def _parse_shard(path: Path) -> tuple[dict[str, object], list[TensorInfo]]:
    buf = _map(path)
    try:
        return _parse_header(buf, path)
    except _Corrupt as e:
        problem = str(e)
    # Outside the except block, so the error does not carry the parser's frames (and their views of the
    # map) as its context: the map is closed now rather than whenever the error object goes away.
    buf.close()
    raise ModelFormatError(f"truncated or corrupt GGUF file: {path} ({problem})")


def _parse_header(buf: mmap.mmap, path: Path) -> tuple[dict[str, object], list[TensorInfo]]:
    cur = _Cursor(buf, 4)
    version = cur.u32("version")
    if version & 0xFFFF == 0:
        raise _Corrupt("big-endian GGUF is not supported")
    if version not in SUPPORTED_VERSIONS:
        raise _Corrupt(f"unsupported GGUF version {version}")
    n_tensors, n_kv = cur.u64("tensor count"), cur.u64("key/value count")
    if n_tensors > cur.size or n_kv > cur.size:  # each entry takes bytes: a huge count is garbage
        raise _Corrupt(f"implausible counts ({n_tensors} tensors, {n_kv} keys)")

    fields: dict[str, object] = {}
    for _ in range(n_kv):
        key = cur.string("key")
        fields[key] = cur.value(cur.u32(f"value type of {key}"), key)

    infos = []  # (name, ggml_type, ne, relative offset)
    for _ in range(n_tensors):
        name = cur.string("tensor name")
        n_dims = cur.u32(f"dims of {name}")
        if n_dims > MAX_DIMS:
            raise _Corrupt(f"tensor {name} has {n_dims} dims")
        ne = [cur.u64(f"shape of {name}") for _ in range(n_dims)]
        ggml_type = cur.u32(f"type of {name}")
        if ggml_type not in GGML_QUANT_SIZES:
            raise _Corrupt(f"tensor {name} has unknown ggml type {ggml_type}")
        infos.append((name, ggml_type, ne, cur.u64(f"offset of {name}")))

    alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise _Corrupt(f"general.alignment {alignment!r} is not a power of two")
    data_start = -(-cur.pos // alignment) * alignment

    tensors = []
    for name, ggml_type, ne, rel in infos:
        qtype = GGMLQuantizationType(ggml_type)
        block, type_size = GGML_QUANT_SIZES[qtype]
        if ne and ne[0] % block:
            raise _Corrupt(
                f"tensor {name} row of {ne[0]} is not a multiple of the {qtype.name} block {block}"
            )
        n_elems = math.prod(ne)  # python ints: a garbage shape must not wrap around to a small size
        n_bytes = n_elems // block * type_size
        start = data_start + rel
        if start + n_bytes > cur.size:
            raise _Corrupt(f"data of tensor {name} runs past the end of the file")
        shape = tuple(int(d) for d in reversed(ne))
        if qtype in _TYPED:
            data = np.frombuffer(buf, dtype=_TYPED[qtype], count=n_elems, offset=start).reshape(shape)
        else:
            byte_shape = (*shape[:-1], shape[-1] // block * type_size) if shape else (type_size,)
            data = np.frombuffer(buf, dtype=np.uint8, count=n_bytes, offset=start).reshape(byte_shape)
        tensors.append(TensorInfo(name, ggml_type, shape, data, n_bytes, str(path), start))
    return fields, tensors


def _is_file(path: Path) -> bool:
    """Path.is_file, with a path that cannot be looked at (EACCES on its folder) as no file."""
    try:
        return path.is_file()
    except OSError:
        return False


def shard_paths(path: Path) -> list[Path]:
    """All shards of a split model named NAME-0000k-of-0000N.gguf (any shard may be given); else [path]."""
    m = SHARD_NAME.match(path.name)
    if not m:
        return [path]
    count = int(m["count"])
    return [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


class GGUFFile:
    """A GGUF model: `fields` (all keys, parsed once), `tensors` across all shards, `hparams`."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.paths = shard_paths(self.path)
        for p in self.paths:
            if p != self.path and not _is_file(p):
                raise ModelFormatError(
                    f"missing shard {p} of split model {self.path.name} ({len(self.paths)} shards)"
                )

        self.fields: dict[str, object] = {}
        self.tensors: dict[str, TensorInfo] = {}
        for i, p in enumerate(self.paths):
            fields, tensors = _parse_shard(p)
            no = fields.get("split.no", i) if len(self.paths) > 1 else i
            if no != i:  # shards renamed or swapped: shard 1's model keys were looked for in another shard
                raise ModelFormatError(
                    f"shard {p} of split model {self.path.name} is shard {no + 1} by its split.no key "
                    "(were the shards renamed?)"
                )
            if i == 0:
                self.fields = fields  # model keys live in shard 1; later shards carry only split.*
            for t in tensors:
                if t.name in self.tensors:
                    raise ModelFormatError(
                        f"truncated or corrupt GGUF file: {p} (tensor {t.name} appears twice)"
                    )
                self.tensors[t.name] = t
        self._check_split()
        self.arch: str = str(self.fields.get("general.architecture", ""))
        try:
            self.hparams: HParams = HParams.from_fields(self.fields)
        except ModelFormatError as e:  # the key's problem alone did not say which file has it
            raise ModelFormatError(f"{self.path}: {e}") from None

    def check_model(self) -> None:
        """What the engine needs beyond the hparams, from the header alone: every tensor it reads, at its
        shape and of a type it runs (tensor_layout.check_tensors), and tokenizer keys it builds a tokenizer
        from. ModelFormatError naming the file and the first problem."""
        from strata_ray.model.tokenizer import check_tokenizer_keys

        try:
            check_tensors(self.hparams, self.tensors)
            check_tokenizer_keys(self.fields)
        except ModelFormatError as e:
            raise ModelFormatError(f"{self.path}: {e}") from None

    def _check_split(self) -> None:
        count = int(self.fields.get("split.count", 1))
        if count != len(self.paths):
            raise ModelFormatError(
                f"split model {self.path.name} has {count} shards but its name says {len(self.paths)} "
                f"(shards must be named NAME-00001-of-{count:05d}.gguf)"
            )
        expected = self.fields.get("split.tensors.count")
        if expected is not None and int(expected) != len(self.tensors):
            raise ModelFormatError(
                f"split model {self.path.name} holds {len(self.tensors)} tensors, expected {expected}"
            )

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelFormatError(f"missing tensor {name}") from None

    def has(self, name: str) -> bool:
        return name in self.tensors

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, arch={self.arch!r}, tensors={len(self.tensors)})"
