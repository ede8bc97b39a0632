"""End to end: a LeRobot v3 latent dataset -> packed training steps of the reference DiT.

    episodes -> lengths -> plan -> sampler -> collate -> block mask -> model -> loss

    python docs/example_lerobot_training.py                  # embedded default dataset, CPU
    python docs/example_lerobot_training.py ~/data/my_robot  # yours, whatever its names and
                                                             # shapes, e.g. observation.latent
                                                             # (16, 8, 16) and action (7,)

The model's two streams (``latents``, ``action``) are read from the dataset's features the way
``packing verify --dataset`` reads them (`packing.verify._command.reference_streams`: a feature of that
name, else the only 3-D / 1-D float feature; ``--feature STREAM=FEATURE`` to choose), and the
model is sized from their shapes.

Runs in seconds on a CPU (tiny model, fp32). On a GPU, pass ``--device cuda``: the model's
attention then runs FlexAttention with the same block mask printed below.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from packing.attention import make_block_mask
from packing.data import PackedCollator, Stream, joint_layout
from packing.datasets import LeRobotEpisodes, default_dataset_root
from packing.model import DiT, DiTConfig
from packing.planning import PackedBatchSampler, plan_packs
from packing.train import reduce_loss
from packing.verify._command import reference_streams


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("root", nargs="?", default=None, help="LeRobot v3 root (default: embedded)")
    p.add_argument("--token-budget", type=int, default=1024, help="video tokens per pack")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--feature", action="append", default=[], metavar="STREAM=FEATURE")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach the hub
    torch.manual_seed(0)
    t_start = time.perf_counter()

    # 1. Episodes: whole episodes as Arrow slices; lengths come from meta/episodes alone.
    #    For a large dataset add cache_dir="..." (decode each parquet file once; ~20x faster).
    root = Path(args.root) if args.root else default_dataset_root()
    info_features = _features(root)
    given = dict(f.split("=", 1) for f in args.feature)
    mapping, sizes = reference_streams(info_features, given, str(root))  # stream -> feature
    episodes = Renamed(LeRobotEpisodes(root, keys=list(mapping.values())), mapping)
    c, h, w = sizes["latent_shape"]
    patch = (1, 2, 2) if h % 2 == 0 and w % 2 == 0 else (1, 1, 1)
    cfg = DiTConfig.tiny(
        latent_channels=c, latent_hw=(h, w), patch=patch, action_dim=sizes["action_dim"]
    )

    # 2. Lengths in tokens of the primary stream (latents): 8x16 latents, 2x2 patches -> 32
    #    tokens per latent frame. The collator's token_budget is the same stream's budget,
    #    a whole number of frames.
    tokens = episodes.dataset.token_lengths(latent_hw=cfg.latent_hw, patch=cfg.patch)
    args.token_budget -= args.token_budget % cfg.tokens_per_frame

    # 3. Plan: bin-pack whole episodes into packs of at most token_budget tokens.
    plan = plan_packs(tokens, args.token_budget)
    fill = tokens.sum() / (len(plan.packs) * args.token_budget)
    print(
        f"{len(episodes)} episodes, {int(tokens.sum())} video tokens -> {len(plan.packs)} packs "
        f"of <= {args.token_budget} tokens ({fill:.0%} full)"
    )

    # 4. Sampler + collate: one pack per step; static padded shapes (token_budget).
    streams = cfg.streams()
    if "action_loss_mask" in episodes[0]:  # the dataset has action_is_pad
        streams.append(Stream("action_loss_mask"))
    loader = DataLoader(
        episodes,
        batch_sampler=PackedBatchSampler(plan=plan, shuffle=True, seed=0),
        collate_fn=PackedCollator(streams, token_budget=args.token_budget, joint=[cfg_joint()]),
        num_workers=args.workers,
    )

    model = DiT(cfg).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses: list[float] = []
    seen: list[int] = []
    step = 0
    for epoch in range(args.epochs):
        loader.batch_sampler.set_epoch(epoch)  # type: ignore[union-attr]
        for batch in loader:
            batch = batch.to(args.device)
            # The model draws each episode's noise and timestep from (seed, step, episode).
            batch.extras.update(seed=0, step=step)

            # 5. Block mask: the document mask of the joint video+action sequence, built from
            #    the episode boundaries. The model builds the same one for its backend inside
            #    (FlexAttention on CUDA; on CPU, SDPA with the dense mask of the same rule).
            joint = joint_layout(batch, cfg_joint()).layout  # built by the collator, cached
            block_mask = make_block_mask(joint.doc_ids_T)

            # 6. Model step: per-token losses, reduced per episode (each episode weighs the
            #    same: what one episode per micro-step + gradient accumulation computes).
            per_token = model(batch)
            mask = batch["action_loss_mask"] if "action_loss_mask" in batch.layouts else None
            loss = reduce_loss(per_token["latents"], batch.layout("latents"), "episode")
            loss = loss + reduce_loss(
                per_token["action"], batch.layout("action"), "episode", loss_mask=mask
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

            k = batch.num_docs
            seen += batch["episode_index"][:k].tolist()
            losses.append(loss.item())
            print(
                f"epoch {epoch} step {step}: {k} episodes {batch['episode_index'][:k].tolist()}, "
                f"{joint.num_tokens}/{joint.padded_len} joint tokens, block mask "
                f"{tuple(block_mask.shape[-2:])} {block_mask.sparsity():.0f}% sparse, "
                f"loss {losses[-1]:.4f}"
            )
            step += 1
    secs = time.perf_counter() - t_start
    print(f"{step} steps in {secs:.1f} s")
    return {
        "losses": losses,
        "episodes_seen": seen,
        "num_episodes": len(episodes),
        "steps": step,
        "streams": mapping,
    }


class Renamed(torch.utils.data.Dataset):
    """The episodes with the dataset's feature names replaced by the model's stream names
    (``observation.latent`` -> ``latents``; a ``_loss_mask`` follows its feature)."""

    def __init__(self, dataset: LeRobotEpisodes, stream_to_feature: dict[str, str]) -> None:
        self.dataset = dataset
        self.names = {f: s for s, f in stream_to_feature.items()}
        self.names |= {f"{f}_loss_mask": f"{s}_loss_mask" for f, s in list(self.names.items())}

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {self.names.get(k, k): v for k, v in self.dataset[i].items()}


def _features(root: Path) -> dict[str, Any]:
    import json

    return json.loads((root / "meta" / "info.json").read_text())["features"]


def cfg_joint() -> tuple[str, str]:
    """The streams the DiT attends over jointly: each episode's video then its actions."""
    return ("latents", "action")


if __name__ == "__main__":
    main()
