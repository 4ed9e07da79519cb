import os
import struct
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from strata_ray.experts.profile import (
    Profile,
    ProfileError,
    check_shape,
    encode_profile,
    learned_profile,
    rank_from_counts,
    read_profile,
    write_profile,
)


def hand_built_strp(n_layers, n_expert, pairs):
    """The STRP v1 layout written out field by field, independently of the module."""
    out = b"STRP" + struct.pack("<5I", 1, n_layers, n_expert, len(pairs), len(pairs))
    for layer, e in pairs:
        out += struct.pack("<HH", layer, e)
    rank = {p: r for r, p in enumerate(pairs)}
    for layer in range(n_layers):
        for e in range(n_expert):
            out += struct.pack("<i", rank.get((layer, e), -1))
    return out


def test_byte_layout_matches_hand_built_bytes(tmp_path):
    pairs = [(1, 2), (0, 0), (2, 1), (1, 0)]
    profile = Profile(3, 4, np.array(pairs))
    expected = hand_built_strp(3, 4, pairs)
    assert encode_profile(profile) == expected
    path = tmp_path / "p.strp"
    write_profile(path, profile)
    assert path.read_bytes() == expected
    assert len(expected) == 24 + 4 * 4 + 4 * 3 * 4  # pairs start at byte 24
    assert expected[24:28] == struct.pack("<HH", 1, 2)


def test_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    profile = rank_from_counts(rng.integers(0, 5, size=(5, 7)))
    path = tmp_path / "p.strp"
    write_profile(path, profile)
    back = read_profile(path)
    assert back == profile
    assert back.path == str(path)
    assert back.rank_table()[tuple(profile.ranked[3])] == 3


def test_atomic_write_leaves_no_tmp_and_replaces(tmp_path):
    path = tmp_path / "p.strp"
    path.write_bytes(b"old contents")
    write_profile(path, Profile(1, 2, np.array([[0, 1]])))
    assert os.listdir(tmp_path) == ["p.strp"]
    assert read_profile(path).ranked.tolist() == [[0, 1]]


def test_unwritable_path_is_one_line(tmp_path):
    with pytest.raises(ProfileError) as e:
        write_profile(tmp_path / "no_such_dir" / "p.strp", Profile(1, 2, np.array([[0, 1]])))
    assert "\n" not in str(e.value) and "cannot write" in str(e.value)


def test_reads_file_without_rank_table_like_the_reference(tmp_path):
    data = hand_built_strp(2, 3, [(1, 1), (0, 2)])[: 24 + 8]
    path = tmp_path / "short.strp"
    path.write_bytes(data)
    assert read_profile(path).ranked.tolist() == [[1, 1], [0, 2]]
    # the header's slots (the count it was built for, bytes 16-19) is not read, as the reference's reader
    path.write_bytes(data[:16] + (8000).to_bytes(4, "little") + data[20:])
    assert read_profile(path).ranked.tolist() == [[1, 1], [0, 2]]


def test_mismatched_shape_is_refused_in_one_line(tmp_path):
    path = tmp_path / "p.strp"
    write_profile(path, Profile(48, 512, np.array([[0, 0]])))
    hp = SimpleNamespace(n_layer=4, n_expert=16)
    with pytest.raises(ProfileError) as e:
        check_shape(read_profile(path), hp)
    assert str(e.value) == (
        f"expert profile {path} is for 48 layers x 512 experts, but the model has 4 layers x 16 experts"
    )
    check_shape(read_profile(path), SimpleNamespace(n_layer=48, n_expert=512))  # matching: no error


@pytest.mark.parametrize(
    "data, words",
    [
        (b"GGUF" + bytes(20), "not an STRP file"),
        (b"STRP" + struct.pack("<5I", 2, 1, 1, 0, 0), "version 2"),
        (b"STRP" + struct.pack("<3I", 1, 1, 1), "truncated"),
        (hand_built_strp(2, 3, [(1, 1), (0, 2)])[:30], "truncated"),
        (b"STRP" + struct.pack("<5I", 1, 2, 3, 1, 1) + struct.pack("<HH", 2, 0), "outside"),
        (b"STRP" + struct.pack("<5I", 1, 2, 3, 2, 2) + struct.pack("<4H", 1, 0, 1, 0), "twice"),
        (b"STRP" + struct.pack("<5I", 1, 2, 3, 7, 7) + b"\0" * 28, "declares 7 ranked pairs, more than its 2 "
         "layers x 3 experts"),
        (b"STRP" + struct.pack("<5I", 1, 0x10000, 2, 0, 0), "bad shape 65536 layers x 2 experts"),
        # a header that declares 4 billion pairs in a 28-byte file: read in pieces, found short
        (b"STRP" + struct.pack("<5I", 1, 0xFFFF, 0xFFFF, 1, 0xFFFF * 0xFFFF) + b"\0" * 4,
         "truncated (28 bytes, 4294836225 ranked pairs need 17179344924)"),
    ],
)
def test_bad_files_are_one_line_errors(tmp_path, data, words):
    path = tmp_path / "bad.strp"
    path.write_bytes(data)
    with pytest.raises(ProfileError) as e:
        read_profile(path)
    msg = str(e.value)
    assert words in msg and str(path) in msg and "\n" not in msg


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero")
def test_an_endless_file_is_read_for_its_header_only():
    """/dev/zero never ends: the reader takes its 24 bytes and refuses them (it used to read until the host's
    memory ran out)."""
    with pytest.raises(ProfileError, match="/dev/zero is not an STRP file"):
        read_profile("/dev/zero")


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS is Linux's")
def test_a_header_declaring_billions_of_pairs_costs_the_files_size(tmp_path):
    """Under a 3 GiB address-space limit, a 28-byte file whose header declares 4 billion pairs is one line
    (a read of all of them at once raised MemoryError there: a traceback)."""
    import subprocess

    path = tmp_path / "big.strp"
    path.write_bytes(b"STRP" + struct.pack("<5I", 1, 0xFFFF, 0xFFFF, 1, 0xFFFF * 0xFFFF) + b"\0" * 4)
    code = f"""
import resource
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
from strata_ray.experts.profile import ProfileError, read_profile
try:
    read_profile({str(path)!r})
except ProfileError as e:
    print(e)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout) == (0, f"expert profile {path} is truncated (28 bytes, 4294836225 ranked "
                                            "pairs need 17179344924)\n"), r.stderr[-1000:]


def test_a_fifo_holding_a_profile_is_read(tmp_path):
    """A shell's `<(cat p.strp)`: the header, then the pairs it declares, from a stream."""
    import threading

    profile = rank_from_counts(np.arange(12).reshape(3, 4))
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_bytes(encode_profile(profile)))
    writer.start()
    try:
        assert read_profile(fifo) == profile
    finally:
        writer.join(timeout=10)


def test_missing_file_is_one_line(tmp_path):
    with pytest.raises(ProfileError, match="cannot read"):
        read_profile(tmp_path / "absent.strp")


def test_rank_from_counts_order():
    counts = np.array(
        [
            [5, 0, 2, 0],
            [2, 0, 0, 7],
            [0, 0, 2, 0],
        ]
    )
    p = rank_from_counts(counts)
    counted = [(1, 3), (0, 0), (0, 2), (1, 0), (2, 2)]  # count desc, ties (2) by (layer, expert)
    # never routed: expert outer, layer inner
    fill = [(2, 0), (0, 1), (1, 1), (2, 1), (1, 2), (0, 3), (2, 3)]
    assert [tuple(x) for x in p.ranked.tolist()] == counted + fill
    assert p.n_ranked == 12


def test_learned_profile_order():
    resident = np.array([[True, False, False], [False, True, False]])
    heat = np.array([[1.0, 9.0, 3.0], [3.0, 4.0, 3.0]])
    prior = Profile(2, 3, np.array([[1, 2], [0, 2]]))  # (1,2) before (0,2); (1,0) unranked
    p = learned_profile(resident, heat, prior)
    # resident by heat: (1,1)=4, (0,0)=1; rest by heat: (0,1)=9, then the 3s by prior: (1,2), (0,2),
    # then unranked (1,0)
    assert [tuple(x) for x in p.ranked.tolist()] == [(1, 1), (0, 0), (0, 1), (1, 2), (0, 2), (1, 0)]
    # no prior: ties by pair id
    p = learned_profile(resident, heat)
    assert [tuple(x) for x in p.ranked.tolist()] == [(1, 1), (0, 0), (0, 1), (0, 2), (1, 0), (1, 2)]


def test_the_model_identity_follows_the_rank_table_and_reads_back(tmp_path):
    """Ours carry the model's routing digest past the rank table, where the reference's reader never looks:
    the first 24 + 4 n bytes (all it reads) and the table are the v1 layout's, byte for byte."""
    from strata_ray.experts.profile import decode_profile

    pairs = [(1, 2), (0, 0), (2, 1), (1, 0)]
    digest = bytes(range(16))
    profile = Profile(3, 4, np.array(pairs), model=digest)
    data = encode_profile(profile)
    assert data == hand_built_strp(3, 4, pairs) + b"STRI" + struct.pack("<I", 1) + digest
    path = tmp_path / "p.strp"
    write_profile(path, profile)
    for back in (read_profile(path), decode_profile(data)):
        assert back == profile and back.model == digest
    assert read_profile(path).completed().model == digest  # kept when the ranking is completed


@pytest.mark.parametrize("tail", [b"", b"STRI" + struct.pack("<I", 1) + bytes(15),
                                  b"STRI" + struct.pack("<I", 2) + bytes(16),
                                  b"XXXX" + struct.pack("<I", 1) + bytes(16)])
def test_a_profile_without_our_identity_names_no_model(tmp_path, tail):
    """The reference's files (nothing past the table), a short or other trailer: no model, no refusal."""
    path = tmp_path / "p.strp"
    path.write_bytes(hand_built_strp(3, 4, [(1, 2), (0, 0)]) + tail)
    assert read_profile(path).model is None


def test_a_profile_short_of_its_rank_table_still_reads_without_a_model(tmp_path):
    """The reference reader needs only the pairs; so does ours, and the identity seek past the end is
    nothing."""
    path = tmp_path / "p.strp"
    path.write_bytes(hand_built_strp(3, 4, [(1, 2), (0, 0)])[: 24 + 8])
    back = read_profile(path)
    assert back.n_ranked == 2 and back.model is None


def test_model_mismatch_is_one_line_only_for_another_model():
    from strata_ray.experts.profile import model_mismatch

    mine, other = bytes(16), bytes([1]) * 16
    assert model_mismatch(Profile(2, 2, np.array([(0, 1)]), path="p.strp"), mine) is None  # names none
    assert model_mismatch(Profile(2, 2, np.array([(0, 1)]), model=mine), mine) is None
    line = model_mismatch(Profile(2, 2, np.array([(0, 1)]), path="p.strp", model=other), mine)
    assert line == ("expert profile p.strp was made on another model of this shape (its routers differ: "
                    "010101010101 against this model's 000000000000)")


def test_learned_and_counted_profiles_carry_the_model_given():
    digest = bytes([7]) * 16
    assert rank_from_counts(np.ones((2, 3)), model=digest).model == digest
    assert learned_profile(np.zeros((2, 3), bool), np.ones((2, 3)), model=digest).model == digest
    assert rank_from_counts(np.ones((2, 3))).model is None
