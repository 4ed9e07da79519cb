"""The expert profile file (STRP v1): a ranking of (layer, expert) pairs, hottest first.

Layout, all integers little-endian (the reference engine's `tools/make_profile.py` / `expert_cache.hpp`):
    bytes 0-3   magic b"STRP"
    bytes 4-23  u32 version (=1), n_layers, n_expert, slots (writers put n_ranked), n_ranked
    byte 24..   n_ranked x (u16 layer, u16 expert), hottest first
    then        n_layers x n_expert i32 rank table (rank of each pair, -1 unranked)
    then        (ours, optional) the model's identity: magic b"STRI", u32 version (=1), 16 bytes of
                model/routing_digest (the routers' digest)
Like the reference reader, `read_profile` needs only 24 + 4*n_ranked bytes, so files written by the reference
engine load unchanged, and it reads ours unchanged (the identity is past what it reads). The identity is
checked only where a file has one (`model_mismatch`): a profile of another model of the same shape is told,
not taken silently.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field

import numpy as np

from strata_ray.atomic_file import write_atomic
from strata_ray.experts.pairs import pair_ids, pairs_of

MAGIC = b"STRP"
VERSION = 1
HEADER = struct.Struct("<4s5I")  # magic, version, n_layers, n_expert, slots, n_ranked
assert HEADER.size == 24
READ_CHUNK = 1 << 20  # bytes of pairs read_profile asks for at a time
IDENTITY = struct.Struct("<4sI16s")  # magic, version, the model's routing digest (after the rank table)
IDENTITY_MAGIC, IDENTITY_VERSION = b"STRI", 1


class ProfileError(Exception):
    """An expert profile that cannot be used. The message is one line meant for the user."""


@dataclass(frozen=True, eq=False)  # eq below: compares the arrays by value
class Profile:
    n_layers: int
    n_expert: int
    ranked: np.ndarray  # [n_ranked, 2] int64 (layer, expert), hottest first
    path: str | None = field(default=None, compare=False)  # where it was read from (for messages)
    model: bytes | None = field(default=None, compare=False)  # routing_digest of the model it was made on

    def __post_init__(self) -> None:
        ranked = np.asarray(self.ranked, dtype=np.int64).reshape(-1, 2)
        object.__setattr__(self, "ranked", ranked)
        _validate_pairs(ranked, self.n_layers, self.n_expert, self.path or "<in memory>")

    @property
    def n_ranked(self) -> int:
        return int(self.ranked.shape[0])

    def pair_ids(self) -> np.ndarray:
        """[n_ranked] int64 pair ids (layer * n_expert + expert), hottest first."""
        return pair_ids(self.ranked, self.n_expert)

    def completed(self) -> Profile:
        """Every pair: the ranked ones first, then the others in the unranked order rank_from_counts appends
        (expert-then-layer). A profile that ranks fewer pairs than a cache holds (older tools wrote 8,000)
        then fills the whole cache instead of leaving slots that no round would ever fill."""
        if self.n_ranked == self.n_layers * self.n_expert:
            return self
        fill = _fill_order(self.n_layers, self.n_expert)
        ranked = self.pair_ids()
        rest = fill[~np.isin(fill, ranked)]
        return Profile(self.n_layers, self.n_expert, pairs_of(np.concatenate([ranked, rest]), self.n_expert),
                       path=self.path, model=self.model)

    def rank_table(self) -> np.ndarray:
        """[n_layers, n_expert] int32: each pair's rank, -1 where unranked."""
        table = np.full(self.n_layers * self.n_expert, -1, dtype=np.int32)
        table[self.pair_ids()] = np.arange(self.n_ranked, dtype=np.int32)
        return table.reshape(self.n_layers, self.n_expert)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Profile):
            return NotImplemented
        return (self.n_layers, self.n_expert) == (other.n_layers, other.n_expert) and np.array_equal(
            self.ranked, other.ranked
        )

    __hash__ = None  # type: ignore[assignment]  # holds an array: not hashable


def _validate_pairs(ranked: np.ndarray, n_layers: int, n_expert: int, where: str) -> None:
    if not (0 < n_layers <= 0xFFFF and 0 < n_expert <= 0xFFFF):
        raise ProfileError(f"expert profile {where}: bad shape {n_layers} layers x {n_expert} experts")
    if ranked.size == 0:
        return
    layer, expert = ranked[:, 0], ranked[:, 1]
    bad = (layer < 0) | (layer >= n_layers) | (expert < 0) | (expert >= n_expert)
    if bad.any():
        i = int(np.argmax(bad))
        raise ProfileError(
            f"expert profile {where}: pair {i} (layer {layer[i]}, expert {expert[i]}) is outside "
            f"{n_layers} layers x {n_expert} experts"
        )
    ids = pair_ids(ranked, n_expert)
    if np.unique(ids).size != ids.size:
        raise ProfileError(f"expert profile {where}: a (layer, expert) pair is ranked twice")


def encode_profile(profile: Profile) -> bytes:
    """The STRP v1 bytes of a profile (slots = n_ranked, as the reference writers do), with its model's
    identity after the rank table where it has one."""
    n = profile.n_ranked
    head = HEADER.pack(MAGIC, VERSION, profile.n_layers, profile.n_expert, n, n)
    pairs = profile.ranked.astype("<u2").tobytes()  # row-major: (layer, expert) per pair
    table = profile.rank_table().astype("<i4").tobytes()
    ident = b"" if profile.model is None else IDENTITY.pack(IDENTITY_MAGIC, IDENTITY_VERSION, profile.model)
    return head + pairs + table + ident


def _header(data: bytes, where: str) -> tuple[int, int, int]:
    """(n_layers, n_expert, n_ranked) of an STRP header (data's first 24 bytes); ProfileError (one line) for a
    short header, another magic or version, a shape past u16, or more pairs than its shape has (each pair is
    ranked once)."""
    if len(data) < HEADER.size:
        raise ProfileError(f"expert profile {where} is truncated ({len(data)} bytes, header needs 24)")
    magic, version, n_layers, n_expert, _slots, n_ranked = HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise ProfileError(f"expert profile {where} is not an STRP file (magic {magic!r}, expected b'STRP')")
    if version != VERSION:
        raise ProfileError(f"expert profile {where} has STRP version {version}; this engine reads version 1")
    if not (0 < n_layers <= 0xFFFF and 0 < n_expert <= 0xFFFF):  # the pairs' u16 fields
        raise ProfileError(f"expert profile {where}: bad shape {n_layers} layers x {n_expert} experts")
    if n_ranked > n_layers * n_expert:
        raise ProfileError(f"expert profile {where} declares {n_ranked} ranked pairs, more than its "
                           f"{n_layers} layers x {n_expert} experts")
    return n_layers, n_expert, n_ranked


def decode_profile(data: bytes, where: str = "<bytes>", tail: bytes | None = None) -> Profile:
    """The profile of an STRP file's bytes; tail: the bytes past its rank table where data stops before them
    (read_profile seeks past the table), else they are data's own."""
    n_layers, n_expert, n_ranked = _header(data, where)
    need = HEADER.size + 4 * n_ranked
    if len(data) < need:
        raise ProfileError(
            f"expert profile {where} is truncated ({len(data)} bytes, {n_ranked} ranked pairs need {need})"
        )
    ranked = np.frombuffer(data, dtype="<u2", count=2 * n_ranked, offset=HEADER.size).reshape(-1, 2)
    model = _identity(data[need + _table_bytes(n_layers, n_expert):] if tail is None else tail)
    return Profile(n_layers, n_expert, ranked.astype(np.int64), path=where, model=model)


def _table_bytes(n_layers: int, n_expert: int) -> int:
    return 4 * n_layers * n_expert


def _identity(tail: bytes) -> bytes | None:
    """The model identity that starts `tail` (the bytes past the rank table), or None: none there (the
    reference's files, ours before it), or another kind of trailer, which is not ours to refuse."""
    if len(tail) < IDENTITY.size:
        return None
    magic, version, digest = IDENTITY.unpack_from(tail, 0)
    return digest if (magic, version) == (IDENTITY_MAGIC, IDENTITY_VERSION) else None


def read_profile(path: str | os.PathLike) -> Profile:
    """The profile at path, reading its header and then no more than the pairs it declares (in pieces, so a
    short file with a header that declares billions costs its own size): a device or a FIFO that never ends
    (/dev/zero) is read for 24 bytes and refused, not read until memory runs out."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER.size)
            need = 4 * _header(head, str(path))[2]
            chunks = [head]
            while need > 0:  # in pieces: a header may declare gigabytes that the file does not hold
                chunk = f.read(min(need, READ_CHUNK))
                if not chunk:
                    break  # decode_profile says how short it is
                chunks.append(chunk)
                need -= len(chunk)
            data, tail = b"".join(chunks), b""
            if not need and f.seekable():  # the identity past the rank table (a pipe's is not looked for)
                f.seek(_table_bytes(*HEADER.unpack_from(head, 0)[2:4]), os.SEEK_CUR)
                tail = f.read(IDENTITY.size)
    except OSError as e:
        raise ProfileError(f"expert profile {path}: cannot read ({e.strerror or e})") from None
    return decode_profile(data, str(path), tail)


def write_profile(path: str | os.PathLike, profile: Profile) -> None:
    """Write atomically (atomic_file.write_atomic: a temporary file beside it, fsync, rename): a reader
    never sees half a file."""
    try:
        write_atomic(path, encode_profile(profile))
    except OSError as e:
        raise ProfileError(f"expert profile {path}: cannot write ({e.strerror or e})") from None


def check_shape(profile: Profile, hp) -> None:
    """Refuse a profile made for another model. `hp` has `.n_layer` (trunk layers) and `.n_expert`."""
    if (profile.n_layers, profile.n_expert) != (hp.n_layer, hp.n_expert):
        raise ProfileError(
            f"expert profile {profile.path or '<in memory>'} is for {profile.n_layers} layers x "
            f"{profile.n_expert} experts, but the model has {hp.n_layer} layers x {hp.n_expert} experts"
        )


def model_mismatch(profile: Profile, digest: bytes) -> str | None:
    """The one line that says a profile was made on another model than the one of this routing digest, or
    None: the same model, or a profile that names none (the reference's, or written before identities).
    Not an error: any placement gives the same output bits; the cache is filled for the other model."""
    if profile.model is None or profile.model == digest:
        return None
    return (f"expert profile {profile.path or '<in memory>'} was made on another model of this shape (its "
            f"routers differ: {profile.model.hex()[:12]} against this model's {digest.hex()[:12]})")


def _fill_order(n_layers: int, n_expert: int) -> np.ndarray:
    """Every pair id in expert-then-layer order (expert outer, layer inner): the reference's fill."""
    layer, expert = np.meshgrid(np.arange(n_layers), np.arange(n_expert), indexing="xy")
    return (layer * n_expert + expert).reshape(-1)  # rows: expert, columns: layer


def rank_from_counts(counts: np.ndarray, model: bytes | None = None) -> Profile:
    """Rank every pair of a [n_layers, n_expert] routing-count table.

    Counted pairs by count descending, ties by (layer, expert); then the never-routed pairs in
    expert-then-layer order, so the profile ranks all pairs and never caps a cache.
    """
    counts = np.asarray(counts)
    n_layers, n_expert = counts.shape
    flat = counts.reshape(-1)
    counted = np.flatnonzero(flat > 0)
    counted = counted[np.argsort(-flat[counted], kind="stable")]  # stable: ties keep pair-id order
    fill = _fill_order(n_layers, n_expert)
    fill = fill[flat[fill] <= 0]
    order = np.concatenate([counted, fill])
    return Profile(n_layers, n_expert, pairs_of(order, n_expert), model=model)


def learned_profile(resident: np.ndarray, heat: np.ndarray, prior: Profile | None = None,
                    model: bytes | None = None) -> Profile:
    """The ranking saved by `--expert-profile-save`, over all pairs of [n_layers, n_expert] tables.

    Resident pairs first (swaps in flight count as resident), then each group by heat (usage summed
    since start) descending, then by the prior profile's rank (unranked last), then by pair id. model: the
    routing digest of the model it was learned on (saved with it).
    """
    resident = np.asarray(resident, dtype=bool)
    heat = np.asarray(heat, dtype=np.float64)
    n_layers, n_expert = resident.shape
    if heat.shape != resident.shape:
        raise ValueError(f"heat {heat.shape} and resident {resident.shape} differ in shape")
    n = n_layers * n_expert
    prior_rank = np.full(n, n, dtype=np.int64)  # unranked after every ranked pair
    if prior is not None and (prior.n_layers, prior.n_expert) == (n_layers, n_expert):
        prior_rank[prior.pair_ids()] = np.arange(prior.n_ranked)
    ids = np.arange(n)
    # lexsort: the last key is the primary one
    order = np.lexsort((ids, prior_rank, -heat.reshape(-1), ~resident.reshape(-1)))
    return Profile(n_layers, n_expert, pairs_of(order, n_expert), model=model)
