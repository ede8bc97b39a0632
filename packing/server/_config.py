"""`ServerConfig`: where the policy server listens and the limits it enforces (plain data).

Safe by default: loopback only; binding any other address needs ``api_key`` (the server
refuses to start without one). Every limit is checked before the server allocates for it:
``max_message_bytes`` is the websocket frame limit (a larger frame closes the connection
with code 1009 before its payload is read; a connection buffers at most 2 frames, so memory
for messages stays under ``max_connections * 3 * max_message_bytes``), ``max_connections`` is
checked in the handshake,
``max_queue`` bounds the requests waiting or running per engine (one more gets a "busy"
reply at once), ``deadline_s`` cancels a request that has not finished in time.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

from packing._validate import check_int, check_real

__all__ = ["ServerConfig"]


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """``host``/``port`` (``port=0``: any free port, see ``PolicyServer.address``);
    ``api_key``: required unless ``host`` is a loopback address; ``metadata``: the map sent to
    each robot on connect (openpi's server metadata); limits as the module docstring says."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_message_bytes: int = 64 * 2**20
    max_connections: int = 64
    max_queue: int = 64
    deadline_s: float = 30.0
    drain_s: float = 30.0
    send_timeout_s: float = 30.0
    handshake_timeout_s: float = 10.0
    summary_every_s: float = 60.0
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise TypeError(f"ServerConfig.host={self.host!r} must be a host name or address")
        check_int("ServerConfig.port", self.port, min=0, max=65535)
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key
                                         or not self.api_key.isascii() or not self.api_key.isprintable()):  # fmt: skip
            raise ValueError("ServerConfig.api_key must be a non-empty printable ASCII string")
        if self.api_key is None and not _loopback(self.host):
            raise ValueError(
                f"binding {self.host!r} serves the network, which needs an API key: pass "
                "api_key= (packing serve: set PACKING_API_KEY), or bind 127.0.0.1"
            )
        for name, top in (("max_message_bytes", 1 << 40), ("max_connections", 1 << 20),
                          ("max_queue", 1 << 20)):  # fmt: skip
            check_int(f"ServerConfig.{name}", getattr(self, name), min=1, max=top)
        check_real("ServerConfig.drain_s", self.drain_s, min=0.0)
        for name in ("deadline_s", "send_timeout_s", "handshake_timeout_s", "summary_every_s"):
            check_real(f"ServerConfig.{name}", getattr(self, name), above=0.0)
        if not isinstance(self.metadata, dict) or not all(
            isinstance(k, str) for k in self.metadata
        ):
            raise TypeError("ServerConfig.metadata must be a dict with str keys")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False
