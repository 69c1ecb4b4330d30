"""The one error type users see: it names the bad field and its value."""


class SpecError(ValueError):
    """Invalid input: `field` had `value`, and `why` says what was expected."""

    def __init__(self, field: str, value, why: str):
        self.field, self.value, self.why = field, value, why
        super().__init__(f"{field}={value!r}: {why}")


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
