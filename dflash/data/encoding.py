"""Text files as real tools write them: UTF-8 with or without a byte-order mark, UTF-16 or UTF-32
with one (Windows editors, PowerShell's `>` and Excel's "Unicode text" write UTF-16 with a BOM).
A BOM read as UTF-8 made the first row of a JSONL file malformed, and a UTF-16 file unreadable."""

from __future__ import annotations

import codecs

from dflash.errors import UserError

# UTF-32 first: its little-endian mark begins with UTF-16's
BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF8, "utf-8"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)


def utf8_bytes(data: bytes, label: str) -> bytes:
    """`data` as UTF-8 without a byte-order mark; bytes without a BOM are taken as UTF-8 (what
    is not is found row by row by the reader, which names the row)."""
    for bom, codec in BOMS:
        if data.startswith(bom):
            if codec == "utf-8":
                return data[len(bom) :]
            try:
                return data.decode(codec).encode("utf-8")
            except UnicodeError as e:
                where = f" at byte {e.start}" if isinstance(e, UnicodeDecodeError) else ""
                raise UserError(
                    f"{label}: starts with a {codec.upper()} byte-order mark but is not valid "
                    f"{codec.upper()}{where}: {getattr(e, 'reason', e)}"
                ) from None
    return data
