"""Hypothesis strategies shared by the fuzz tests."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

json_values: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=30,
)
"""Any value JSON text can carry (and the floats it cannot: NaN, infinities)."""
