"""A minimal policy server: environment processes send requests over local sockets to ONE
engine, which packs whatever is waiting into its next model call.

::

    env 0 --\\                      +--------------------------------+
    env 1 ---+-- 127.0.0.1:port --> | PolicyServer: queue -> Engine  | one model call per step
    env 2 --/   (one socket each)   |  over every pending request    |
                                    +--------------------------------+

Wire format (no pickle: a server must not unpickle what a socket sends): a message is an
8-byte big-endian length, a JSON header, then the raw bytes of the arrays the header lists
(``{"arrays": [{"name", "dtype", "shape"}], ...}``, float32, C order). A request carries
``context`` and the `Request` fields; a reply carries ``latents`` and ``action``.

Bounded by design: `PolicyServer.serve` returns after ``max_requests`` replies or
``timeout_s`` seconds, and binds 127.0.0.1 only.
"""

from __future__ import annotations

import json
import queue
import socket
import struct
import threading
import time
from typing import Any

import numpy as np
import torch

from packing.serve._engine import Engine
from packing.serve._request import Request

__all__ = ["PolicyClient", "PolicyServer"]

_FIELDS = ("frames", "actions", "task", "seed", "steps", "keep_frames")


def send_message(
    sock: socket.socket, header: dict[str, Any], arrays: dict[str, np.ndarray]
) -> None:
    """One message: length, JSON header (with the arrays' names, dtypes, shapes), bytes."""
    parts = [np.ascontiguousarray(a, dtype=np.float32) for a in arrays.values()]
    meta = [{"name": n, "shape": list(a.shape)} for n, a in zip(arrays, parts, strict=True)]
    head = json.dumps({**header, "arrays": meta}).encode()
    body = b"".join(a.tobytes() for a in parts)
    sock.sendall(struct.pack(">II", len(head), len(body)) + head + body)


def recv_message(sock: socket.socket) -> tuple[dict[str, Any], dict[str, np.ndarray]] | None:
    """The next message, or None when the peer closed the connection."""
    raw = _recv_exact(sock, 8)
    if raw is None:
        return None
    n_head, n_body = struct.unpack(">II", raw)
    head = json.loads(_recv_exact(sock, n_head) or b"{}")
    body = _recv_exact(sock, n_body) if n_body else b""
    if body is None:
        raise ConnectionError("the peer closed the connection in the middle of a message")
    arrays, offset = {}, 0
    for meta in head.pop("arrays", []):
        n = int(np.prod(meta["shape"], dtype=np.int64)) * 4
        arrays[meta["name"]] = np.frombuffer(body[offset : offset + n], np.float32).reshape(
            meta["shape"]
        )
        offset += n
    return head, arrays


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


class PolicyClient:
    """An environment's side: ``PolicyClient(address).act(context, frames=..., ...)`` returns
    ``(latents, action)`` as numpy arrays. Numpy only: an environment needs no torch."""

    def __init__(self, address: tuple[str, int], timeout_s: float = 60.0) -> None:
        self.sock = socket.create_connection(address, timeout=timeout_s)

    def act(self, context: np.ndarray, **fields: Any) -> tuple[np.ndarray, np.ndarray]:
        unknown = set(fields) - set(_FIELDS)
        if unknown:
            raise ValueError(f"PolicyClient.act: unknown fields {sorted(unknown)}; use {_FIELDS}")
        send_message(self.sock, {"fields": fields}, {"context": context})
        reply = recv_message(self.sock)
        if reply is None:
            raise ConnectionError("the policy server closed the connection")
        head, arrays = reply
        if "error" in head:
            raise ValueError(f"the policy server rejected the request: {head['error']}")
        return arrays["latents"], arrays["action"]

    def close(self) -> None:
        self.sock.close()


class PolicyServer:
    """Serve an `Engine` on ``127.0.0.1`` (``port=0``: any free port, see ``address``)."""

    def __init__(self, engine: Engine, port: int = 0) -> None:
        self.engine = engine
        self.listener = socket.create_server(("127.0.0.1", port))
        self.address: tuple[str, int] = self.listener.getsockname()[:2]
        self._inbox: queue.Queue[tuple[socket.socket, dict[str, Any], dict[str, np.ndarray]]]
        self._inbox = queue.Queue()
        self.steps_with: list[int] = []  # requests in each model call (what packing bought)

    def serve(self, max_requests: int, timeout_s: float = 120.0) -> int:
        """Answer ``max_requests`` requests (or stop after ``timeout_s``); returns how many."""
        threading.Thread(target=self._accept, daemon=True).start()
        owner: dict[int, socket.socket] = {}
        answered, deadline = 0, time.monotonic() + timeout_s
        while answered < max_requests and time.monotonic() < deadline:
            self._take_requests(owner, block=not (self.engine.active or self.engine.waiting))
            if not (self.engine.active or self.engine.waiting):
                continue
            results = self.engine.step()
            self.steps_with.append(len(self.engine.last_pack))
            for r in results:
                arrays = {"latents": r.latents.cpu().numpy(), "action": r.action.cpu().numpy()}
                send_message(owner.pop(r.request_id), {"request_id": r.request_id}, arrays)
                answered += 1
        self.listener.close()
        return answered

    def _take_requests(self, owner: dict[int, socket.socket], block: bool) -> None:
        """Submit everything that arrived; wait a little for the first one when idle."""
        try:
            item = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            conn, head, arrays = item
            try:
                fields = dict(head.get("fields", {}))
                if fields.get("keep_frames") is not None:
                    fields["keep_frames"] = tuple(fields["keep_frames"])
                req = Request(context=torch.from_numpy(arrays["context"].copy()), **fields)
                owner[self.engine.submit(req)] = conn
            except (ValueError, TypeError, KeyError) as e:
                send_message(conn, {"error": str(e)}, {})
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:  # the listener was closed: serve() is done
                return
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        """One thread per client: its messages go to the engine's inbox in order."""
        with conn:
            while True:
                try:
                    msg = recv_message(conn)
                except OSError:
                    return
                if msg is None:
                    return
                self._inbox.put((conn, *msg))
