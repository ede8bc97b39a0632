"""The policy server: robots speak openpi's websocket protocol to `packing.serve` engines.

- `PolicyServer`, `ServerConfig`: msgpack with numpy arrays, metadata on connect,
  ``/healthz`` (503 until every engine has warmed up), an API key off loopback, to one or
  more engines whose continuous batcher packs every robot's requests together
  (docs/serving.md; ``packing serve``).
- `DiTAdapter`, `WanAdapter`: an observation dict becomes a request, a result the reply.
- `PolicyClient`, `ServerError`: a robot's side in Python (openpi-client works too).

Importing this folder needs nothing more than `packing.serve`; running a server or a client
needs the ``serve`` extra (websockets, msgpack), checked in one place when one starts
(the ``serve`` extra, README: Install).
"""

from packing.server._adapter import DiTAdapter, WanAdapter
from packing.server._client import PolicyClient, ServerError
from packing.server._config import ServerConfig
from packing.server._server import PolicyServer

__all__ = [
    "DiTAdapter",
    "PolicyClient",
    "PolicyServer",
    "ServerConfig",
    "ServerError",
    "WanAdapter",
]
