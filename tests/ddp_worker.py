"""Worker for tests/test_ddp.py, launched as ``torchrun --nproc_per_node=2 ddp_worker.py OUT``.

Trains a Linear(8, 1) with DDP on gloo/CPU over uneven, variable-length synthetic episodes
packed by PackedBatchSampler and collated by PackedCollator, three times:

    full      epochs 0 and 1 without a break
    resumed   epoch 0, epoch 1 up to step k, state saved; a new model and sampler load it
              and finish epoch 1 -> parameters must equal the full run's
    tiny      one episode on two ranks: one rank gets an empty pack, the step must not hang

Rank 0 writes what the test checks to OUT (JSON).
"""

from __future__ import annotations

import gc
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from packing.data import PackedCollator, Stream
from packing.planning import PackedBatchSampler

BUDGET = 64


def make_episodes(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(11)
    w_true = torch.randn(8, 1, generator=g)
    lengths = torch.randint(1, 40, (n,), generator=g).tolist()
    eps = []
    for i, length in enumerate(lengths):
        x = torch.randn(length, 8, generator=g)
        eps.append({"x": x, "y": x @ w_true, "episode_index": i})
    return eps


def train(
    eps: list[dict],
    epochs: range,
    *,
    stop: tuple[int, int] | None = None,
    resume: dict | None = None,
) -> dict:
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    if resume is not None:
        model.load_state_dict(resume["model"])
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.02)
    sampler = PackedBatchSampler(
        [len(e["x"]) for e in eps], BUDGET, seed=3, balance="attention"
    )  # rank and world size come from torch.distributed
    if resume is not None:
        sampler.load_state_dict(resume["sampler"])
    # Declared step shapes let the collator build an all-padding batch for an empty pack.
    streams = [
        Stream("x", step_shape=(8,), dtype=torch.float32, budget=BUDGET),
        Stream("y", step_shape=(1,), dtype=torch.float32, budget=BUDGET),
    ]
    loader = DataLoader(eps, batch_sampler=sampler, collate_fn=PackedCollator(streams))
    seen: dict[int, list[int]] = {}
    steps = 0
    for epoch in epochs:
        sampler.set_epoch(epoch)
        seen[epoch] = []
        for step, batch in enumerate(loader):
            if stop == (epoch, step):
                # The loader already drew this pack: save what training has consumed.
                state = {"sampler": sampler.state_dict(consumed=step), "model": model.state_dict()}
                return {"state": state, "seen": seen, "steps": steps}
            weight_T = (batch["doc_ids"] >= 0).float()  # padding carries no loss
            num_tokens = weight_T.sum()
            dist.all_reduce(num_tokens)  # the global normaliser: token mean over all ranks
            err_T = (ddp(batch["x"]) - batch["y"]).squeeze(-1) ** 2
            # DDP averages gradients over ranks, so scale by world to get the global mean.
            loss = (err_T * weight_T).sum() / num_tokens.clamp(min=1) * world
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps += 1
            seen[epoch] += [int(i) for i in batch["episode_index"].tolist() if i >= 0]
    return {"model": model.state_dict(), "seen": seen, "steps": steps, "len": len(sampler)}


def gather(x: object) -> list:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, x)
    return out


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    eps = make_episodes(37)
    full = train(eps, range(2))
    first = train(eps, range(2), stop=(1, 3))
    rest = train(eps, range(1, 2), resume=first["state"])
    tiny = train(make_episodes(1), range(1))
    report = {
        "lengths": [len(e["x"]) for e in eps],
        "full_seen": gather(full["seen"]),
        "full_steps": gather(full["steps"]),
        "full_len": gather(full["len"]),
        "resumed_seen_epoch1": gather(first["seen"][1] + rest["seen"][1]),
        "params_max_diff": max(
            float((full["model"][k] - rest["model"][k]).abs().max()) for k in full["model"]
        ),
        "tiny_seen": gather(tiny["seen"]),
        "tiny_steps": gather(tiny["steps"]),
        "tiny_params_finite": bool(all(torch.isfinite(v).all() for v in tiny["model"].values())),
    }
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(report, f)
    dist.barrier()
    gc.collect()  # DDP's reducers (in reference cycles) go while their process group lives
    dist.destroy_process_group()
    # Every check ran and rank 0 wrote the report: skip the interpreter's teardown, where a
    # gloo thread still holding work aborted a rank on a loaded machine (SIGABRT, "terminate
    # called without an active exception", both attempts of one CI run; a torch teardown
    # issue, see pytorch/pytorch#179291), after everything this test checks had run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
