"""The one boundary of the ``serve`` extra: websockets and msgpack, imported when a server, a
client or the wire format first needs them, with the install hint when they are missing."""

from __future__ import annotations

import importlib
from typing import Any

from packing._lazy import install_hint

__all__ = ["serve_extra"]


def serve_extra(module: str) -> Any:
    """``module`` (``"msgpack"``, ``"websockets.asyncio.server"``, ...), or an ImportError
    that says which extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"the policy server needs websockets and msgpack ({module} is missing): "
            f"{install_hint('serve')}"
        ) from e
