"""Several simulated robots against one packed policy server, end to end.

The server (`packing.server.PolicyServer`, openpi's websocket protocol on 127.0.0.1) serves the
tiny reference DiT; each robot is a thread with its own `PolicyClient` connection (as a
separate computer would have) and its own control rate. A robot runs a bounded closed loop: send its last context frames, get the
next latent frame and action chunk back, "execute" the chunk (sleep chunk / rate), append
the new frame to its context, repeat ``--rounds`` times, end its episode, disconnect. The
server packs whatever requests are waiting into each model call::

    python examples/policy_server.py --clients 4 --rounds 3

prints how many requests each model call held. Runs on the CPU in a few seconds; on a GPU
pass --device cuda. An unmodified openpi-client robot works the same way (docs/serving.md).
"""

from __future__ import annotations

import argparse
import queue
import sys
import threading
from typing import Any

import numpy as np
import torch

from packing.model import DiT, DiTConfig
from packing.serve import Engine, EngineConfig, FlowScheduler, PackShape
from packing.server import DiTAdapter, PolicyClient, PolicyServer, ServerConfig

FRAME = (8, 4, 8)  # (C, H, W) latents of the tiny model
ADAPTER = DiTAdapter(frames=1, actions=4, steps=4)


def build_engine(device: str = "cpu", requests: int = 8) -> Engine:
    torch.manual_seed(0)
    cfg = DiTConfig.tiny(latent_channels=8, latent_hw=(4, 8), action_dim=6, frame_causal=True)
    model = DiT(cfg).to(device).eval()
    shapes = tuple(PackShape(frames=3 * n, actions=4 * n, requests=n)
                   for n in (1, 2, 4, 8) if n <= requests)  # fmt: skip
    config = EngineConfig(shapes=shapes, scheduler=FlowScheduler(solver="multistep2"))
    return Engine(model, config)


def robot(address: tuple[str, int], client: int, rounds: int, hz: float, out: Any) -> None:
    """One robot: a bounded loop of requests at its own control rate; numpy only."""
    import time

    rng = np.random.default_rng(client)
    context = rng.standard_normal((2, *FRAME)).astype(np.float32)
    with PolicyClient(*address, timeout_s=60) as policy:
        for r in range(rounds):
            obs = {"context": context, "prompt": f"robot {client}", "seed": 100 * client + r}
            reply = policy.infer(obs)
            out.put((client, r, obs, reply["latents"], reply["actions"]))
            time.sleep(len(reply["actions"]) / hz)  # the chunk runs out at this robot's rate
            context = np.concatenate([context, reply["latents"]])[-2:]
        policy.end_episode()


def run_demo(clients: int = 4, rounds: int = 3, device: str = "cpu") -> dict[str, Any]:
    """Serve ``clients`` robot processes for ``rounds`` chunks each; every exchange and the
    server's summary (requests per model call, latency)."""
    if isinstance(clients, bool) or not isinstance(clients, int) or clients < 1:
        raise ValueError(f"--clients {clients!r}: give 1 or more robots")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"--rounds {rounds!r}: give 1 or more chunks per robot")
    server = PolicyServer(build_engine(device), ADAPTER, ServerConfig(port=0))
    out: queue.Queue[Any] = queue.Queue()
    with server.running() as address:
        procs = [threading.Thread(target=robot, args=(address, c, rounds, 40.0 + 20 * c, out))
                 for c in range(clients)]  # fmt: skip
        for p in procs:
            p.start()
        exchanges = [out.get(timeout=120) for _ in range(clients * rounds)]
        for p in procs:
            p.join(timeout=60)
    return {"exchanges": exchanges, "summary": server.summary()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    try:
        demo = run_demo(args.clients, args.rounds, args.device)
    except ValueError as e:
        print(f"policy_server.py: error: {e}", file=sys.stderr)
        return 2
    s = demo["summary"]
    print(f"answered {s['answered']} chunks for {args.clients} robots in {s['model_calls']} "
          f"model calls; requests per call: max {s['max_requests_per_call']}, mean "
          f"{s['requests_per_call']}; latency p50 {s['p50_ms']} ms, p99 {s['p99_ms']} ms")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
