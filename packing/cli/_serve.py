"""``packing serve``: the policy server for robots (openpi's websocket protocol) on one or more
engines, until SIGINT/SIGTERM (then it drains and exits 0).

::

    packing serve                                   # the tiny reference DiT, 127.0.0.1:8000, CPU
    PACKING_API_KEY=... packing serve --host 0.0.0.0 --model wan_2_2_5b --checkpoint dit.pt \\
        --device cuda:0 --device cuda:1 --cuda-graphs --shape 96,128,8
    packing serve --mask frame-causal --context-cache 256   # each episode's context cached
    packing serve --model my_robot.policy:build     # build(device) -> Engine | VideoEngine
                                                    #   or (engine, adapter)

Any address but loopback needs an API key (``--api-key``, or PACKING_API_KEY so it is not in
the process list). Before serving, every pack shape and prefill pass is compiled and captured
("warming 9 of 14 shapes"; ``/healthz`` says 503 until then). One log line per connection, a
summary every ``--summary-every-s`` (with the compiles and captures since the warm-up: 0).
docs/serving.md has the wire format, the observation keys and the security settings.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from packing.cli._parser import device, file, pattern, real, text, whole

PRESETS = ("tiny", "wan_1_3b", "wan_2_2_5b")
MODEL = pattern(
    r"[\w.]+(:[\w.]+)?", "my_robot.policy:build", f"a preset {PRESETS} or 'module:factory'"
)
SHAPE = pattern(r"\d+,\d+,\d+", "96,128,8", "FRAMES,ACTIONS,REQUESTS")


def add_parser(sub: Any) -> None:
    s = sub.add_parser(
        "serve",
        help="serve a policy to robots over openpi's websocket protocol, packing their requests",
        description=__doc__.split("::")[0].strip(),
    )
    s.add_argument("--model", default="tiny", type=MODEL,
                   help=f"a reference DiT preset {PRESETS} or module:factory (default tiny)")  # fmt: skip
    s.add_argument(
        "--checkpoint",
        default=None,
        type=file("a state_dict file (.pt)"),
        help="a state_dict file for the preset (.pt)",
    )
    s.add_argument(
        "--device", action="append", type=device(), help="repeatable: one engine each (default cpu)"
    )
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    s.add_argument("--shape", action="append", type=SHAPE, metavar="FRAMES,ACTIONS,REQUESTS",
                   help="a static pack (repeatable; default 1, 2, 4 and 8 requests); FRAMES: "
                        "context + generated frames, with --context-cache generated only")  # fmt: skip
    s.add_argument("--mask", default="document", choices=["document", "frame-causal"],
                   help="a preset's attention inside an episode (as it was trained)")  # fmt: skip
    s.add_argument("--context-cache", type=whole(1, 2**20, "context cache pages"), default=None, metavar="PAGES",
                   help="cache each episode's context in a pool of PAGES pages (frame-causal "
                        "presets; docs/serving.md)")  # fmt: skip
    s.add_argument("--page-frames", type=whole(1, 1024, "latent frames a page"), default=None,
                   help="with --context-cache: latent frames a page (default 4)")  # fmt: skip
    s.add_argument("--prefill-frames", type=whole(1, 4096, "frames a prefill pass"), action="append",
                   help="with --context-cache: a prefill pass's frames (repeatable; default 4, 32)")  # fmt: skip
    s.add_argument("--cuda-graphs", action="store_true", help="capture each shape's step")
    s.add_argument("--compile", action="store_true", help="compile the DiT's blocks")
    s.add_argument(
        "--max-steps",
        type=whole(1, 1000, "denoising steps"),
        default=50,
        help="most denoising steps a request asks",
    )
    s.add_argument(
        "--frames",
        type=whole(1, 1024, "latent frames a chunk"),
        default=1,
        help="latent frames a chunk generates (1)",
    )
    s.add_argument(
        "--actions",
        type=whole(1, 4096, "action steps a chunk"),
        default=16,
        help="action steps a chunk generates (16)",
    )
    s.add_argument(
        "--steps",
        type=whole(1, 1000, "denoising steps"),
        default=10,
        help="denoising steps by default (10)",
    )
    s.add_argument("--context-frames", type=whole(0, 4096, "context frames"), default=4,
                   help="the most context frames a chunk keeps (4): room in the default shapes, "
                        "or with --context-cache each pack's window of pages")  # fmt: skip
    _add_server_options(s)


def _add_server_options(s: argparse.ArgumentParser) -> None:
    """The server's own: address, key, limits, timing."""
    s.add_argument(
        "--host",
        default="127.0.0.1",
        type=text("a bind address"),
        help="bind address (default 127.0.0.1)",
    )
    s.add_argument(
        "--port", type=whole(0, 65535, "a TCP port"), default=8000, help="0: any free port (logged)"
    )
    s.add_argument("--api-key", default=os.environ.get("PACKING_API_KEY") or None,
                   type=text("an API key"),
                   help="required off loopback (default: $PACKING_API_KEY)")  # fmt: skip
    s.add_argument(
        "--max-message-mb", type=real(0, 4096, "MiB a message", above=True), default=64.0
    )
    s.add_argument("--max-connections", type=whole(1, 65_536, "connections"), default=64)
    s.add_argument(
        "--max-queue",
        type=whole(1, 2**20, "queued requests"),
        default=64,
        help="requests per engine, then 'busy'",
    )
    s.add_argument(
        "--deadline-s",
        type=real(0, 86_400, "seconds", above=True),
        default=30.0,
        help="a request's time limit",
    )
    s.add_argument(
        "--drain-s",
        type=real(0, 3600, "seconds"),
        default=30.0,
        help="shutdown waits this long at most",
    )
    s.add_argument(
        "--summary-every-s", type=real(0.1, 86_400, "seconds between summaries"), default=60.0
    )


def run(args: argparse.Namespace) -> int:
    from packing.server import PolicyServer, ServerConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("websockets").setLevel(logging.WARNING)
    if args.max_message_mb <= 0:
        raise ValueError(f"--max-message-mb {args.max_message_mb} must be > 0")
    config = ServerConfig(
        host=args.host, port=args.port, api_key=args.api_key or None,
        max_message_bytes=int(args.max_message_mb * 2**20), max_connections=args.max_connections,
        max_queue=args.max_queue, deadline_s=args.deadline_s, drain_s=args.drain_s,
        summary_every_s=args.summary_every_s,
        metadata={"model": args.model, "frames": args.frames, "actions": args.actions,
                  "steps": args.steps},
    )  # fmt: skip
    built = [_build(args, device) for device in (args.device or ["cpu"])]
    engines = [engine for engine, _ in built]
    model_config = getattr(getattr(engines[0], "model", None), "config", None)
    if model_config is not None:  # a robot reads what to send from the metadata
        shape = [model_config.latent_channels, *model_config.latent_hw]
        config.metadata.update(latent_shape=shape, action_dim=model_config.action_dim)
    cache = getattr(engines[0].config, "context_cache", None) if model_config else None
    if cache is not None:  # a robot learns that sending context + new frames is cheap
        config.metadata.update(
            context_cache={"pages": cache.pages, "page_frames": cache.page_frames}
        )
    server = PolicyServer(engines, built[0][1], config)
    server.serve_forever()
    return 0


def _build(args: argparse.Namespace, device: str) -> tuple[Any, Any]:
    """One engine on ``device`` and its adapter."""
    import torch

    from packing.model import DiT, DiTConfig
    from packing.serve import Engine, EngineConfig
    from packing.server import DiTAdapter

    adapter = DiTAdapter(frames=args.frames, actions=args.actions, steps=args.steps)
    cache = _context_cache(args)
    if args.model not in PRESETS:
        if args.checkpoint is not None:
            raise ValueError("--checkpoint loads a preset's weights; a factory loads its own")
        if cache is not None or args.mask != "document":
            raise ValueError("--context-cache and --mask build a preset's engine; a factory "
                             "builds its own (EngineConfig(context_cache=ContextCache(...)))")  # fmt: skip
        from packing.verify import load_factory

        out = load_factory(args.model)(device)
        return out if isinstance(out, tuple) else (out, None)
    torch.manual_seed(0)  # the same random weights in every engine without a checkpoint
    model = DiT(getattr(DiTConfig, args.model)(frame_causal=args.mask == "frame-causal"))
    if args.checkpoint is not None:
        state = torch.load(args.checkpoint, map_location="cpu", weights_only=True)  # no pickle code
        model.load_state_dict(state)
    model = model.to(device, getattr(torch, args.dtype)).eval()
    if args.compile:
        for block in model.blocks:
            block.compile(dynamic=False)
    config = EngineConfig(shapes=_shapes(args, cached=cache is not None),
                          max_steps=args.max_steps, cuda_graphs=args.cuda_graphs,
                          context_cache=cache)  # fmt: skip
    try:
        return Engine(model, config), adapter
    except ValueError as e:
        if cache is None or model.config.frame_causal:
            raise
        raise ValueError(f"--context-cache: {e} (packing serve: --mask frame-causal, for a "
                         "model trained so)") from e  # fmt: skip


def _context_cache(args: argparse.Namespace) -> Any:
    """``--context-cache PAGES`` (with ``--page-frames``, ``--prefill-frames``) as a
    `ContextCache`, or None; a cache flag without ``--context-cache`` is refused."""
    from packing.serve import ContextCache

    if args.context_cache is None:
        given = [f for f, v in (("--page-frames", args.page_frames),
                                ("--prefill-frames", args.prefill_frames)) if v is not None]  # fmt: skip
        if given:
            raise ValueError(
                f"{', '.join(given)} sizes the context cache; add --context-cache PAGES"
            )
        return None
    extra: dict[str, Any] = {"context_frames": args.context_frames}
    if args.page_frames is not None:
        extra["page_frames"] = args.page_frames
    if args.prefill_frames is not None:
        extra["prefill_frames"] = tuple(args.prefill_frames)
    return ContextCache(pages=args.context_cache, **extra)


def _shapes(args: argparse.Namespace, cached: bool = False) -> tuple[Any, ...]:
    """``--shape``s, or packs of 1, 2, 4 and 8 requests (a lone robot is not computed as 8);
    with the context cache a shape's frames are the generated ones (the pool holds the rest)."""
    from packing.serve import PackShape

    if not args.shape:
        per = args.frames if cached else args.context_frames + args.frames
        return tuple(PackShape(frames=n * per,
                               actions=n * args.actions, requests=n) for n in (1, 2, 4, 8))  # fmt: skip
    shapes = []
    for spec in args.shape:
        parts = spec.split(",")
        if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"--shape {spec!r}: give FRAMES,ACTIONS,REQUESTS, e.g. 96,128,8")
        f, a, r = (int(p) for p in parts)
        shapes.append(PackShape(frames=f, actions=a, requests=r))
    return tuple(shapes)
