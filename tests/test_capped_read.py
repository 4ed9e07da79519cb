"""capped_read: text or bytes to their end up to a cap; one more is refused, and no more is read."""

import io

import pytest

from strata_ray.capped_read import MIB, TooLong, read_capped


@pytest.mark.parametrize("kind", [io.StringIO, io.BytesIO])
def test_up_to_the_cap_and_refused_past_it(kind):
    unit = "x" if kind is io.StringIO else b"x"
    assert read_capped(kind(unit * 5), 5) == unit * 5
    assert read_capped(kind(unit * 0), 5) == unit * 0
    f = kind(unit * (2 * MIB))
    with pytest.raises(TooLong, match=r"^longer than 1 MiB$"):
        read_capped(f, MIB)
    assert f.tell() == MIB + 1  # what an endless source gives: the cap and one more, then the refusal
