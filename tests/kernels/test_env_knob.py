"""An env-only knob's value where it acts (strata_ray/kernels/env_knob.py)."""

from __future__ import annotations

import pytest

from strata_ray.config import int_range
from strata_ray.kernels.env_knob import env_knob


def test_unset_or_empty_is_the_default_and_a_set_value_is_parsed(monkeypatch):
    monkeypatch.delenv("STRATA_TEST_KNOB", raising=False)
    assert env_knob("STRATA_TEST_KNOB", int_range(1, 9), 5) == 5
    monkeypatch.setenv("STRATA_TEST_KNOB", "")
    assert env_knob("STRATA_TEST_KNOB", int_range(1, 9), 5) == 5
    monkeypatch.setenv("STRATA_TEST_KNOB", "7")
    assert env_knob("STRATA_TEST_KNOB", int_range(1, 9), 5) == 7


def test_a_bad_value_is_one_line_naming_the_variable(monkeypatch):
    monkeypatch.setenv("STRATA_TEST_KNOB", "12")
    with pytest.raises(ValueError) as e:
        env_knob("STRATA_TEST_KNOB", int_range(1, 9), 5)
    assert str(e.value) == "STRATA_TEST_KNOB: invalid value '12' (allowed: an integer from 1 to 9)"
