"""The suite's own settings (tests/conftest.py) hold in every test module: a Hypothesis example
has no deadline, so a loaded machine cannot fail a property that holds."""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st


def test_hypothesis_examples_have_no_deadline() -> None:
    assert settings.default is not None and settings.default.deadline is None
    assert settings(max_examples=3).deadline is None, "a test's own settings inherit it"


@settings(max_examples=2)
@given(st.integers())
def test_an_example_slower_than_hypothesis_default_deadline_passes(_: int) -> None:
    time.sleep(0.25)  # Hypothesis's default deadline is 200 ms
