"""Worker for tests/test_lingbot_va.py's Accelerate check, one of two CPU processes
(RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT in the environment, gloo).

Every process builds the same PackedBatchSampler (num_replicas=2) and iterates a DataLoader
that ``accelerator.prepare`` re-shards, two ways:

    all_ranks   DataLoader(batch_sampler=sampler.all_ranks())   the recipe
    per_rank    DataLoader(batch_sampler=sampler with rank=r)   the trap: prepare shards again

and writes the episode ids it saw (two epochs of the recipe, one of the trap) to OUT.rank.json.
"""

from __future__ import annotations

import json
import sys

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from packing.planning import PackedBatchSampler

LENGTHS = [5, 17, 3, 9, 12, 8, 2, 30, 7, 11, 4, 6, 21, 14, 1]


def main(out: str) -> None:
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    assert accelerator.num_processes == 2, accelerator.num_processes
    seen: dict[str, list[list[int]]] = {}
    for name in ("all_ranks", "per_rank"):
        sampler = PackedBatchSampler(LENGTHS, 32, num_replicas=2, rank=rank, seed=3)
        batches = sampler.all_ranks() if name == "all_ranks" else sampler
        loader = accelerator.prepare(
            DataLoader(range(len(LENGTHS)), batch_sampler=batches, collate_fn=list)
        )
        for epoch in range(2 if name == "all_ranks" else 1):
            loader.set_epoch(epoch)
            seen[f"{name}/{epoch}"] = [list(map(int, b)) for b in loader]
            seen[f"{name}/{epoch}/own"] = [list(p) for p in _own(sampler, epoch)]
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(seen, f)
    accelerator.wait_for_everyone()


def _own(sampler: PackedBatchSampler, epoch: int) -> list[list[int]]:
    sampler.set_epoch(epoch)
    return [list(p) for p in sampler]


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1])
