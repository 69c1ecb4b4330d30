"""CSV at the boundary: an uploaded file bounded in size and rows before anything parses it, and
cells that a spreadsheet would run as a formula neutralised in every CSV offered for download."""
from __future__ import annotations

from perfmodel.util.errors import SpecError, require

MAX_UPLOAD_BYTES = 16 * 2**20   # one uploaded CSV
MAX_UPLOAD_ROWS = 100_000       # its data rows (comment lines not counted)
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")  # what a spreadsheet reads as a formula (OWASP)


def csv_text(data: bytes, name: str, field: str = "upload", max_bytes: int = MAX_UPLOAD_BYTES,
             max_rows: int = MAX_UPLOAD_ROWS) -> str:
    """The UTF-8 text of an uploaded CSV without its `#` comment lines, refused (one SpecError
    naming the file) when larger than `max_bytes` or longer than `max_rows` rows; linear time."""
    require(len(data) <= max_bytes, field, name, f"larger than {max_bytes / 2**20:g} MiB "
                                                 f"({len(data) / 2**20:.1f} MiB)")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise SpecError(field, name, f"not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start})") from None
    lines = [l for l in text.splitlines() if not l.startswith("#")]
    require(len(lines) - 1 <= max_rows, field, name, f"more than {max_rows} rows ({len(lines) - 1})")
    return "\n".join(lines)


def neutral(cell):
    """`cell` safe to open in a spreadsheet: text starting with = + - @ (or a tab / carriage
    return) gets a leading apostrophe, so it shows as text and never runs as a formula; numbers
    and other values are returned as they are."""
    return "'" + cell if isinstance(cell, str) and cell.startswith(FORMULA_START) else cell
