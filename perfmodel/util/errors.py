"""The one error type users see: it names the file (when there is one), the bad field and its value."""
from __future__ import annotations

import contextlib

MAX_VALUE_CHARS = 200  # a value longer than this is cut in the message


class SpecError(ValueError):
    """Invalid input: `field` had `value`, and `why` says what was expected; `file` is the input
    file it came from (set by `in_file` around a loader), None for a command-line value."""

    def __init__(self, field: str, value, why: str, file: str | None = None):
        self.field, self.value, self.why, self.file = field, value, why, file
        super().__init__(self.message())

    def message(self) -> str:
        where = f"{self.file}: " if self.file else ""
        return f"{where}{self.field}={_short(self.value)}: {self.why}"

    def __str__(self) -> str:
        return self.message()

    def __reduce__(self):  # whole across processes (a sweep's workers)
        return SpecError, (self.field, self.value, self.why, self.file)


def _short(value) -> str:
    try:
        text = repr(value)
    except ValueError:  # an integer of more than sys.get_int_max_str_digits() digits
        text = f"<an integer of {value.bit_length()} bits>"
    return text if len(text) <= MAX_VALUE_CHARS else text[:MAX_VALUE_CHARS - 3] + "..."


@contextlib.contextmanager
def in_file(path):
    """Name `path` in every SpecError raised inside that names no file yet (a loader wraps its
    checks in it, so a field error says which file it is in)."""
    try:
        yield
    except SpecError as e:
        if e.file is None and str(e.value) != str(path):
            e.file = str(path)
            e.args = (e.message(),)
        raise


def require(cond: bool, field: str, value, why: str) -> None:
    if not cond:
        raise SpecError(field, value, why)


def positive_int(field: str, value) -> int:
    require(isinstance(value, int) and not isinstance(value, bool) and value > 0,
            field, value, "must be a positive integer")
    return value


def nonnegative(field: str, value) -> float:
    require(isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0,
            field, value, "must be a number >= 0")
    return float(value)
