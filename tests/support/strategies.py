"""Hypothesis strategies the tests share."""

from __future__ import annotations

from hypothesis import strategies as st

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=30,
)
"""Any JSON value as Python holds it: lone surrogates in the text, floats of every exponent."""
