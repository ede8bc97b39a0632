"""`PolicyClient`: a robot's side of the protocol in Python, numpy only (no torch needed).

It speaks what openpi-client's ``WebsocketClientPolicy`` speaks (metadata on connect, one
msgpack observation, one msgpack reply or a text error line), so either client talks to the
server; this one adds a timeout on every call and the episode messages::

    with PolicyClient("127.0.0.1", 8000) as robot:
        robot.metadata                                   # what the server sent on connect
        reply = robot.infer({"context": frames, "prompt": "pick"})
        reply["actions"], reply["server_timing"]
        robot.end_episode()                              # {"episode": "end"}
"""

from __future__ import annotations

from typing import Any

from packing.server._extra import serve_extra
from packing.server._wire import decode, encode

__all__ = ["PolicyClient", "ServerError"]


class ServerError(RuntimeError):
    """The server answered with an error line (a bad observation, busy, a deadline)."""


class PolicyClient:
    """``PolicyClient(host, port, api_key=None, timeout_s=60)``: one robot's connection."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 8000,
        *,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        max_message_bytes: int = 256 * 2**20,
    ) -> None:
        connect = serve_extra("websockets.sync.client").connect
        headers = {"Authorization": f"Api-Key {api_key}"} if api_key else None
        self.timeout_s, self.max_message_bytes = timeout_s, max_message_bytes
        opened = connect(f"ws://{host}:{port}", compression=None, max_size=max_message_bytes,
                         additional_headers=headers, open_timeout=timeout_s)  # fmt: skip
        self._ws = opened.__enter__()  # the connection (websockets >= 16 warns without enter)
        self.metadata = self._recv()

    def infer(self, observation: dict[str, Any]) -> dict[str, Any]:
        """Send one observation; the reply (``actions``, ``server_timing``, ...) or a
        `ServerError` with the server's one-line reason."""
        self._ws.send(encode(observation))
        return self._recv()

    def end_episode(self) -> dict[str, Any]:
        """The robot's episode ended: the server frees its session (its cached context)."""
        return self.infer({"episode": "end"})

    def close(self) -> None:
        self._ws.close()

    def __enter__(self) -> PolicyClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _recv(self) -> dict[str, Any]:
        data = self._ws.recv(timeout=self.timeout_s)
        if isinstance(data, str):
            raise ServerError(data)
        return decode(data, max_array_bytes=self.max_message_bytes)
