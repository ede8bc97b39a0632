"""How much of what a served LingBot-VA step computes is a robot's, by pack shape set.

A static pack shape computes every slot, filled or not. This counts, for robots in step (all
joining at once, the closed loop of bench_lingbot_serve.py) and out of step (robot r joining
r/N of a chunk's steps after robot 0, as robots that started at different times are), the
query tokens the engine's steps computed and the share of them that were robots' (the rest
is padding), under three shape sets: `phase_shapes` (the default), each loop alone plus one
mixed shape (the default before it), and one mixed shape (the first GPU run's). Counts, not
times: they are the same on any machine, so this runs on the CPU with LeRobot's LingBot-VA
at toy widths but LIBERO's geometry (two 128x128 cameras: 8 x 16 latents, 4 latent frames
and 16 actions a chunk) and LingBot-VA's own schedule (20 video steps with guidance, 50
action steps); a step's time on a GPU at 5B widths grows with its tokens
(bench_lingbot_serve.py measures that).

    python benchmarks/serving/fill_lingbot_packs.py            # 4, 8 robots, ~1 minute
    python benchmarks/serving/fill_lingbot_packs.py --quick    # 2 robots, the smoke schedule
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.harness.results import base_parser, markdown_table, write_json
from benchmarks.serving.bench_lingbot_serve import LIBERO, PACKS, SMOKE, packed

TOY = dict(num_attention_heads=2, attention_head_dim=12, ffn_dim=32, num_layers=1, text_dim=16,
           freq_dim=16, action_dim=30)  # fmt: skip


def toy_policy(quick: bool) -> Any:
    """LeRobot's LingBotVAPolicy at toy widths, LIBERO's geometry and LingBot-VA's schedule
    (``quick``: the smoke schedule)."""
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.lingbot_va.configuration_lingbot_va import LingBotVAConfig
    from lerobot.policies.lingbot_va.modeling_lingbot_va import LingBotVAPolicy

    cams = ["observation.images.image", "observation.images.image2"]
    visual = PolicyFeature(type=FeatureType.VISUAL, shape=(3, 128, 128))
    schedule = {**LIBERO, **SMOKE} if quick else LIBERO
    cfg = LingBotVAConfig(**TOY, **schedule, attn_mode="torch", dtype="float32",
                          obs_cam_keys=cams, device="cpu",
                          input_features={k: visual for k in cams})  # fmt: skip
    torch.manual_seed(0)
    return LingBotVAPolicy(cfg).eval()


def fill_row(policy: Any, robots: int, packs: str, stagger: bool, chunks: int) -> dict:
    run = packed(policy, robots, chunks, 1, False, packs, stagger=stagger)
    st = run["stats"]
    done = run["chunks"] + robots  # the untimed first chunk of each robot ran too
    return {
        "robots": robots,
        "arrival": "out of step" if stagger else "in step",
        "packs": packs,
        "fill": st["query_tokens_filled"] / st["query_tokens_computed"],
        "tokens_per_chunk": st["query_tokens_computed"] / done,
        "steps": {k: st[f"steps_in_{k}_packs"] for k in ("video", "action", "mixed")},
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--robots", type=int, nargs="+", default=[4, 8])
    p.add_argument("--chunks", type=int, default=3, help="chunks a robot (after its first)")
    args = p.parse_args(argv)
    if args.quick:
        args.robots, args.chunks = [2], 2
    if args.device != "cpu":
        p.error("counts are the same on any device: run it with --device cpu")
    policy = toy_policy(args.quick)
    rows = []
    for robots in args.robots:
        for stagger in (False, True):
            for packs in PACKS:
                rows.append(fill_row(policy, robots, packs, stagger, args.chunks))
                print(rows[-1], flush=True)
    for r in rows:  # tokens a chunk against the one mixed shape's, same robots and arrival
        base = next(b for b in rows if b["robots"] == r["robots"] and b["arrival"] == r["arrival"]
                    and b["packs"] == "mixed")  # fmt: skip
        r["x_fewer_tokens"] = base["tokens_per_chunk"] / r["tokens_per_chunk"]
    print(markdown_table(rows, ["robots", "arrival", "packs", "fill", "tokens_per_chunk",
                                "x_fewer_tokens"]))  # fmt: skip
    payload = {"rows": rows, "packs": PACKS}
    write_json("fill_lingbot_packs", args, payload, device="cpu")
    return payload


if __name__ == "__main__":
    main()
