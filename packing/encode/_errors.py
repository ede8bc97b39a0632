"""The error `packing encode` raises on bad input: a ValueError that names the episode, the
file and the fix (``packing encode`` exits 2 on it)."""

from __future__ import annotations

__all__ = ["EncodeError"]


class EncodeError(ValueError):
    """Bad input to `packing.encode.encode_dataset`: the message names the episode, the file
    or the argument, and the fix."""
