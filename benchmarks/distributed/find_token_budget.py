"""Find the largest pack (tokens) that trains on this GPU: binary search on the token budget.

For a model config, one full training step (bf16 autocast forward, backward, AdamW step) is
tried on a pack of ``T`` tokens; an out-of-memory error means "too big". The search halves
the interval until it is ``--resolution`` tokens wide and reports the largest ``T`` that
fitted, its peak memory, and the step time at that size. This answers "how many K tokens per
GPU?" for your model: use it for ``token_budget`` (leave headroom: a fragmenting allocator or
a longer text can add a few GB; ``--headroom`` subtracts a fraction).

    python benchmarks/distributed/find_token_budget.py --preset wan_2_2_5b --depth 30
    python benchmarks/distributed/find_token_budget.py --preset wan_1_3b --depth 30 --episode-frames 240
    python benchmarks/distributed/find_token_budget.py --quick      # tiny model on CPU, for CI

Your own model: copy ``try_budget`` and replace the DiT with your model and its batch.
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks import harness
from packing.data import PackedCollator, Stream
from packing.model import DiT, DiTConfig, param_count, text_tokens


def pack_of(cfg: DiTConfig, tokens: int, episode_frames: int, rng: torch.Generator) -> Any:
    """Episodes of ``episode_frames`` frames (the last one shorter) filling ``tokens``."""
    tpf = cfg.tokens_per_frame
    frames_total = tokens // tpf
    eps, i = [], 0
    while frames_total > 0:
        f = min(episode_frames, frames_total)
        c, (h, w) = cfg.latent_channels, cfg.latent_hw
        eps.append({
            "latents": torch.randn(f, c, h, w, generator=rng),
            "action": torch.randn(f, cfg.action_dim, generator=rng),
            "text": text_tokens(f"task {i}", cfg.text_len),
            "episode_index": i,
        })  # fmt: skip
        frames_total -= f
        i += 1
    collator = PackedCollator(
        [Stream("latents", grid=cfg.grid, budget=tokens // tpf * tpf), Stream("action"),
         Stream("text")],
        pad_to_multiple=128,
    )  # fmt: skip
    batch = collator(eps)
    batch.extras["seed"], batch.extras["step"] = 0, 0
    return batch


def try_budget(model: torch.nn.Module, opt: torch.optim.Optimizer, cfg: DiTConfig, tokens: int,
               args: Any, dev: torch.device) -> dict[str, Any]:  # fmt: skip
    """One training step at ``tokens``: {'fits', 'peak_gb', 'step_ms'}."""
    rng = torch.Generator().manual_seed(tokens)
    batch = pack_of(cfg, tokens, args.episode_frames, rng)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    try:
        for _ in range(args.repeats):
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                out = model(batch)
            loss = out["latents"].sum() / tokens + out["action"].sum() / tokens
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        harness.sync(dev)
    except torch.OutOfMemoryError:
        out = loss = None  # free the partial graph before the next try
        opt.zero_grad(set_to_none=True)
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        return {"tokens": tokens, "fits": False}
    ms = (time.perf_counter() - t0) * 1e3 / args.repeats
    peak = torch.cuda.max_memory_allocated() / 1e9 if dev.type == "cuda" else 0.0
    return {"tokens": tokens, "fits": True, "peak_gb": peak, "step_ms": ms,
            "episodes": batch.num_docs}  # fmt: skip


def main() -> None:
    p = harness.base_parser(__doc__.splitlines()[0])
    p.add_argument("--preset", default="wan_2_2_5b", choices=["wan_1_3b", "wan_2_2_5b", "tiny"])
    p.add_argument("--depth", type=int, default=30)
    p.add_argument("--episode-frames", type=int, default=240, help="frames per episode (32 tok)")
    p.add_argument("--lo", type=int, default=2048)
    p.add_argument("--hi", type=int, default=524288)
    p.add_argument("--resolution", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=1, help="steps per try (2 catches a later OOM)")
    p.add_argument("--headroom", type=float, default=0.05, help="fraction to leave free")
    p.add_argument("--backend", default="auto")
    args = p.parse_args()
    dev = torch.device(args.device)
    if args.quick:
        args.preset, args.depth, args.lo, args.hi, args.resolution = "tiny", 1, 256, 2048, 256
        args.episode_frames = 4
    preset = getattr(DiTConfig, args.preset)
    cfg = preset(depth=args.depth, attention=args.backend if dev.type == "cuda" else "auto")
    torch.manual_seed(args.seed)
    with torch.device(dev):  # initialise on the GPU: a 5B model on the CPU takes minutes
        model = DiT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=dev.type == "cuda")
    tries = []
    lo, hi = args.lo, args.hi
    first = try_budget(model, opt, cfg, lo, args, dev)
    tries.append(first)
    print(first, flush=True)
    best = first if first["fits"] else None
    if best is not None:
        top = try_budget(model, opt, cfg, hi, args, dev)
        tries.append(top)
        print(top, flush=True)
        if top["fits"]:
            best = top
        else:
            while hi - lo > args.resolution:
                mid = (lo + hi) // 2 // args.resolution * args.resolution
                if mid <= lo:
                    break
                r = try_budget(model, opt, cfg, mid, args, dev)
                tries.append(r)
                print(r, flush=True)
                if r["fits"]:
                    lo, best = mid, r
                else:
                    hi = mid
    rows = [
        {
            "preset": args.preset,
            "depth": args.depth,
            "params (B)": param_count(cfg) / 1e9,
            "episode frames": args.episode_frames,
            "largest pack (tokens)": None if best is None else best["tokens"],
            "with headroom": None if best is None else int(best["tokens"] * (1 - args.headroom)),
            "peak GB": None if best is None else best["peak_gb"],
            "step ms at that size": None if best is None else best["step_ms"],
            "smallest OOM": min((t["tokens"] for t in tries if not t["fits"]), default=None),
        }
    ]
    print(harness.markdown_table(rows, list(rows[0])))
    harness.write_json(f"token_budget_{args.preset}_d{args.depth}", args,
                      {"rows": rows, "tries": tries, "model": cfg.__dict__}, device=dev)  # fmt: skip


if __name__ == "__main__":
    main()
