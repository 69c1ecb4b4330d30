"""Strict inputs and stale outputs.

A number is typed as text and parsed whole: `1e9` is 1,000,000,000 (then refused if out of
range), `4.5` is not an integer, an empty field is "default" only where a default exists. A bad
field shows its message beside it; the outputs that depend on it keep their last good state,
greyed out, with the reason.
"""
from __future__ import annotations

import math
from contextlib import contextmanager

import streamlit as st

STALE_CSS = ("<style>[class*='st-key-stale_']{opacity:.35;filter:grayscale(100%);}"
             "[class*='st-key-stale_'] *{pointer-events:none;}</style>")


def parse_number(text: str | None, label: str, *, integer: bool, lo: float, hi: float,
                 allow_empty: bool = False) -> tuple[float | int | None, str | None]:
    """(value, None) or (None, message). Empty is (None, None) where allowed."""
    s = (text or "").strip().replace("_", "")
    if not s:
        return (None, None) if allow_empty else (None, f"{label}: enter a number")
    try:
        x = float(s)
    except ValueError:
        return None, f"{label}: '{text}' is not a number"
    if not math.isfinite(x):
        return None, f"{label}: '{text}' is not a finite number"
    if integer:
        if not x.is_integer():
            return None, f"{label}: '{text}' is not a whole number"
        x = int(x)
    if not lo <= x <= hi:
        return None, f"{label}: {x:,g} is out of range ({lo:,g} to {hi:,g})"
    return x, None


def parse_values(text: str | None, label: str = "Batch sizes", *, integer: bool = True, lo: float = 1,
                 hi: float = 4096, most: int = 32, example: str = "1, 2, 4, 8") -> tuple[list, str | None]:
    """A comma- or space-separated list of numbers, sorted, without repeats."""
    parts = [p for p in (text or "").replace(",", " ").split() if p]
    if not parts:
        return [], f"{label}: enter at least one, e.g. {example}"
    out = set()
    for p in parts:
        v, err = parse_number(p, label, integer=integer, lo=lo, hi=hi)
        if err:
            return [], err
        out.add(v)
    if len(out) > most:
        return [], f"{label}: at most {most} values"
    return sorted(out), None


def parse_batches(text: str | None, lo: int = 1, hi: int = 4096, most: int = 32) -> tuple[list[int], str | None]:
    """A comma- or space-separated list of batch sizes, sorted, without repeats."""
    return parse_values(text, lo=lo, hi=hi, most=most)


def number_field(col, label: str, key: str, *, integer: bool = True, lo: float = 1, hi: float = 4096,
                 allow_empty: bool = False, errors: list | None = None, **kw):
    """A text field parsed strictly; its message goes right under it and into `errors`."""
    text = col.text_input(label, key=key, **kw)
    value, err = parse_number(text, label, integer=integer, lo=lo, hi=hi, allow_empty=allow_empty)
    if err:
        col.error(err, icon=":material/error:")
        if errors is not None:
            errors.append(err)
    return value


def batches_field(col, label: str, key: str, errors: list | None = None, parse=parse_batches, **kw) -> list:
    """A list of numbers typed as text (`parse`: text -> (values, message)); its message under it."""
    values, err = parse(col.text_input(label, key=key, **kw))
    if err:
        col.error(err, icon=":material/error:")
        if errors is not None:
            errors.append(err)
    return values


def current_or_last(name: str, current, reason: str | None):
    """The inputs to draw: the current ones when valid (remembered), else the last valid ones.

    Returns (inputs or None, stale reason or None)."""
    slot = f"_last_good_{name}"
    if reason is None:
        st.session_state[slot] = current
        return current, None
    return st.session_state.get(slot), reason


@contextmanager
def maybe_stale(reason: str | None, key: str):
    """Draw inside a greyed-out container with the reason above it when `reason` is set."""
    if reason is None:
        yield
        return
    st.markdown(STALE_CSS, unsafe_allow_html=True)
    st.caption(f":orange[**Stale**: greyed out, drawn for the last valid inputs ({reason}).]")
    with st.container(key=f"stale_{key}"):
        yield
