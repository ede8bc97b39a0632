"""A policy server for several robots: N environment processes, one packed engine.

Each environment runs a bounded closed loop: send its last context frames over a local
socket, get the next latent frame and action chunk back, append the frame to its context,
repeat ``rounds`` times, exit. The server packs whatever requests are waiting into each
model call (`packing.serve.Engine`) and stops by itself after answering them all::

    python examples/policy_server.py --clients 3 --rounds 2

Runs on the CPU with the tiny reference DiT in a few seconds; on a GPU pass --device cuda.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
from typing import Any

import numpy as np
import torch

from packing.model import DiT, DiTConfig
from packing.serve import (
    Engine,
    EngineConfig,
    FlowScheduler,
    PackShape,
    PolicyClient,
    PolicyServer,
)

FRAME = (8, 4, 8)  # (C, H, W) latents of the tiny model
FIELDS = dict(frames=1, actions=4, steps=4)


def build_engine(device: str = "cpu") -> Engine:
    torch.manual_seed(0)
    cfg = DiTConfig.tiny(latent_channels=8, latent_hw=(4, 8), action_dim=6, frame_causal=True)
    model = DiT(cfg).to(device).eval()
    shapes = (PackShape(frames=8, actions=16, requests=4),)
    config = EngineConfig(shapes=shapes, scheduler=FlowScheduler(solver="multistep2"))
    return Engine(model, config)


def environment(address: tuple[str, int], client: int, rounds: int, out: Any) -> None:
    """One robot: a bounded loop of requests; numpy only."""
    rng = np.random.default_rng(client)
    context = rng.standard_normal((2, *FRAME)).astype(np.float32)
    env = PolicyClient(address)
    for r in range(rounds):
        fields = dict(FIELDS, task=f"robot {client}", seed=100 * client + r)
        latents, action = env.act(context, **fields)
        out.put((client, r, context, fields, latents, action))
        context = np.concatenate([context, latents])[-2:]  # the new frame joins the context
    env.close()


def run_demo(clients: int = 3, rounds: int = 2, device: str = "cpu") -> dict[str, Any]:
    """Serve ``clients`` environment processes for ``rounds`` requests each; returns every
    exchange and how many requests each model call held."""
    engine = build_engine(device)
    server = PolicyServer(engine)
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=environment, args=(server.address, c, rounds, out))
             for c in range(clients)]  # fmt: skip
    for p in procs:
        p.start()
    answered = server.serve(max_requests=clients * rounds, timeout_s=120.0)
    exchanges = [out.get(timeout=30) for _ in range(answered)]
    for p in procs:
        p.join(timeout=30)
    return {"answered": answered, "exchanges": exchanges, "steps_with": server.steps_with,
            "engine": engine}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--clients", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    demo = run_demo(args.clients, args.rounds, args.device)
    calls = demo["steps_with"]
    print(f"answered {demo['answered']} requests from {args.clients} environments in "
          f"{len(calls)} model calls; requests per call: max {max(calls)}, "
          f"mean {sum(calls) / len(calls):.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
