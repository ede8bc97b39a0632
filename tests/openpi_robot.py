"""A robot on openpi-client 0.1.2, run by tests/test_serve_openpi.py in its OWN venv (numpy < 2,
as a robot computer would have): ``python openpi_robot.py HOST PORT SEED FOLDER [KEY] [nan]``.

It connects with the unmodified ``WebsocketClientPolicy``, writes ``ready`` once it has the
server's metadata, waits for ``go`` (so every robot's request reaches the server together),
sends two observations and saves what came back (``robot<SEED>.npz``, no pickle). A refused
connection exits 3 with the error's type on stdout. With ``nan`` the first observation holds
a NaN: the client must raise the server's one-line error, and the connection goes on."""

import json
import sys
import time
from pathlib import Path

import numpy as np
from openpi_client.websocket_client_policy import WebsocketClientPolicy

host, port, seed, folder = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
key = sys.argv[5] if len(sys.argv) > 5 and sys.argv[5] != "-" else None
nan = sys.argv[6:] == ["nan"]
try:
    policy = WebsocketClientPolicy(host, port, api_key=key)
except Exception as e:  # the handshake was refused (a wrong or missing key)
    print(type(e).__name__, e)
    sys.exit(3)
(folder / f"ready{seed}").write_text(json.dumps(policy.get_server_metadata()))
end = time.monotonic() + 60
while not (folder / "go").exists():
    if time.monotonic() > end:
        sys.exit(4)
    time.sleep(0.01)
rng = np.random.default_rng(seed)
saved = {}
if nan:
    bad = np.full((2, 8, 4, 8), np.nan, np.float32)
    try:
        policy.infer({"context": bad, "seed": 0})
    except RuntimeError as e:  # openpi-client raises on a text reply
        (folder / f"error{seed}").write_text(str(e))
for k in range(2):
    context = rng.standard_normal((2, 8, 4, 8)).astype(np.float32)
    reply = policy.infer({"context": context, "seed": 10 * seed + k, "prompt": f"robot {seed}"})
    saved.update(
        {
            f"context{k}": context,
            f"actions{k}": reply["actions"],
            f"latents{k}": reply["latents"],
            f"infer_ms{k}": reply["server_timing"]["infer_ms"],
        }
    )
np.savez(folder / f"robot{seed}.npz", **saved)
