"""The one error a bad media item raises: it names the row, the key and the fix.

Must not: import anything heavy; the dataset reader catches it to count and skip a row.
"""

from __future__ import annotations


class MediaError(ValueError):
    """A media item that cannot be used: unreadable, oversized, or not matching its prompt.

    ``where`` says which item (e.g. ``row 17, key 'images'[2]``), ``reason`` what is wrong,
    ``fix`` what the user can do. The message holds all three.
    """

    def __init__(self, where: str, reason: str, fix: str) -> None:
        self.where = where
        self.reason = reason
        self.fix = fix
        super().__init__(f"{where}: {reason}; {fix}")


def item_label(row: int | str | None, key: str | None, index: int | None = None) -> str:
    """``row 17, key 'images'[2]``: how a media item is named in errors."""
    parts = []
    if row is not None:
        parts.append(f"row {row}")
    if key is not None:
        parts.append(f"key {key!r}" + (f"[{index}]" if index is not None else ""))
    elif index is not None:
        parts.append(f"item {index}")
    return ", ".join(parts) or "media item"
