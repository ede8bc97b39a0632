"""Loss reductions: packed == the per-episode loop, however episodes are split into packs,
micro-steps and ranks; the mean of per-pack means is not."""

from __future__ import annotations

import os
import tempfile
import time
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from packing.data import StreamLayout, layout_from_lengths
from packing.train import (
    LossNormalizer,
    Reduction,
    global_denominator,
    local_denominator,
    reduce_loss,
    token_weights,
)

PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NAN = float("nan")
REDUCTIONS: tuple[Reduction, ...] = ("token", "frame", "episode")
TOKEN_AND_EPISODE: tuple[Reduction, ...] = ("token", "episode")


def _layout(lengths: list[int], padded: int, tps: int = 1) -> StreamLayout:
    return layout_from_lengths(lengths, [n // tps for n in lengths], padded, tokens_per_step=tps)


# -- the per-episode loop: the unpacked reference, written independently -------------------------
def reference(
    losses: list[torch.Tensor], masks: list[torch.Tensor], reduction: Reduction, tps: int = 1
) -> float:
    """Each episode alone: plain Python over its tokens, steps and episodes."""
    if reduction == "token":
        num = sum(float((ell * m).sum()) for ell, m in zip(losses, masks, strict=True))
        den = sum(float(m.sum()) for m in masks)
        return num / den if den else 0.0
    means = []
    for ell, m in zip(losses, masks, strict=True):
        groups = [(0, len(ell))] if reduction == "episode" else [
            (s, s + tps) for s in range(0, len(ell), tps)
        ]  # fmt: skip
        for a, b in groups:
            mass = float(m[a:b].sum())
            if mass > 0:
                means.append(float((ell[a:b] * m[a:b]).sum()) / mass)
    return sum(means) / len(means) if means else 0.0


# -- the worked example of docs/losses.md ------------------------------------------------------
# lengths [2, 4, 3]; the last token of episode 2 is action_is_pad (its loss 100 must not count)
EP_LOSS = [
    torch.tensor([1.0, 3.0]),
    torch.tensor([2.0, 4.0, 6.0, 8.0]),
    torch.tensor([3.0, 9.0, 100.0]),
]
EP_MASK = [torch.ones(2), torch.ones(4), torch.tensor([1.0, 1.0, 0.0])]


def test_worked_example_one_pack() -> None:
    lay = _layout([2, 4, 3], 10)
    loss = torch.cat([*EP_LOSS, torch.tensor([NAN])])  # padding may hold anything, even NaN
    mask = torch.cat([*EP_MASK, torch.ones(1)]).bool()
    assert reduce_loss(loss, lay, "token", mask).item() == pytest.approx(36 / 8)
    assert reduce_loss(loss, lay, "episode", mask).item() == pytest.approx((2 + 5 + 6) / 3)
    assert reduce_loss(loss, lay, "frame", mask).item() == pytest.approx(36 / 8)  # 1 token/step
    assert token_weights(lay, "episode").tolist() == pytest.approx(
        [1 / 2, 1 / 2, 1 / 4, 1 / 4, 1 / 4, 1 / 4, 1 / 3, 1 / 3, 1 / 3, 0]
    )
    assert token_weights(lay, "episode", mask).tolist()[6:] == pytest.approx([1 / 2, 1 / 2, 0, 0])


def test_worked_example_two_micro_steps_global_vs_mean_of_means() -> None:
    """Pack A = episodes 0 and 1, pack B = episode 2, one micro-step each."""
    lay_a, lay_b = _layout([2, 4], 8), _layout([3], 4)
    loss_a = torch.cat([EP_LOSS[0], EP_LOSS[1], torch.tensor([NAN, 7.0])])
    loss_b = torch.cat([EP_LOSS[2], torch.tensor([50.0])])
    mask_a, mask_b = torch.ones(8), torch.cat([EP_MASK[2], torch.ones(1)])
    for red, want in zip(TOKEN_AND_EPISODE, (4.5, 13 / 3), strict=True):
        d = local_denominator([lay_a, lay_b], red, [mask_a, mask_b])
        ours = sum(
            reduce_loss(ell, lay, red, m, denominator=d)
            for ell, lay, m in ((loss_a, lay_a, mask_a), (loss_b, lay_b, mask_b))
        )
        assert float(ours) == pytest.approx(want)
        assert want == pytest.approx(reference(EP_LOSS, EP_MASK, red))
    # Each micro-step's own token mean, averaged over micro-steps: (24/6 + 12/2) / 2 = 5.
    mean_of_means = (
        reduce_loss(loss_a, lay_a, "token", mask_a) + reduce_loss(loss_b, lay_b, "token", mask_b)
    ) / 2
    assert float(mean_of_means) == pytest.approx(5.0)  # neither 4.5 nor 4.333: wrong


def test_frame_reduction_by_hand() -> None:
    # Steps of 2 tokens; episode 0 has 1 step, episode 1 has 2; one token of step 1 masked.
    lay = _layout([2, 4], 8, tps=2)
    loss = torch.tensor([1.0, 3.0, 10.0, 20.0, 5.0, 7.0, NAN, NAN])
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 1, 1]).bool()
    assert token_weights(lay, "frame", mask).tolist() == [0.5, 0.5, 0, 1, 0.5, 0.5, 0, 0]
    # steps: (1+3)/2 = 2, 20, (5+7)/2 = 6 -> 28/3; the token mean would be 36/5.
    assert reduce_loss(loss, lay, "frame", mask).item() == pytest.approx(28 / 3)
    assert reduce_loss(loss, lay, "step", mask).item() == pytest.approx(28 / 3)
    assert reduce_loss(loss, lay, "token", mask).item() == pytest.approx(36 / 5)
    assert local_denominator(lay, "frame").item() == 3
    # Raw doc ids work too, given the frame size.
    ids = lay.doc_ids_T
    assert torch.equal(token_weights(ids, "frame", mask, 2), token_weights(lay, "frame", mask))


def test_channels_are_averaged_first() -> None:
    lay = _layout([2, 1], 4)
    loss_TD = torch.tensor([[1.0, 3.0], [2.0, 2.0], [0.0, 8.0], [NAN, NAN]])
    for red in TOKEN_AND_EPISODE:
        assert torch.equal(reduce_loss(loss_TD, lay, red), reduce_loss(loss_TD.mean(1), lay, red))
    bf16 = reduce_loss(loss_TD.bfloat16(), lay, "episode")
    assert bf16.dtype == torch.float32 and bf16.item() == pytest.approx((2 + 4) / 2)


# -- the property: packed == per-episode loop, whatever the split ----------------------------------
def test_packed_reductions_equal_the_episode_loop_under_any_split() -> None:
    """Random episodes, masks, packs, micro-steps and fake DP ranks (summed as all_reduce
    would); the mean of per-pack means must differ from the reference on many of them."""
    seen = Counter[str]()

    @PROPERTY
    @given(
        tps=st.sampled_from([1, 2, 3]),
        steps=st.lists(st.integers(1, 5), min_size=1, max_size=9),
        ranks=st.integers(1, 3),
        data=st.data(),
    )
    def check(tps: int, steps: list[int], ranks: int, data: st.DataObject) -> None:
        gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
        losses = [torch.rand(n * tps, generator=gen, dtype=torch.float64) * 10 for n in steps]
        masks = [
            (
                torch.rand(n * tps, generator=gen) > data.draw(st.sampled_from([0.0, 0.3, 0.9]))
            ).double()
            for n in steps
        ]
        # Episodes -> packs (consecutive in a random order) -> ranks (round robin; spare
        # ranks get an all-padding pack, as a rank with no episode does).
        order = data.draw(st.permutations(range(len(steps))))
        cuts = sorted(
            data.draw(st.sets(st.integers(1, len(steps) - 1))) if len(steps) > 1 else set()
        )
        groups = [list(order[a:b]) for a, b in zip([0, *cuts], [*cuts, len(steps)], strict=True)]
        rank_packs: list[list[tuple[torch.Tensor, StreamLayout, torch.Tensor]]] = [
            [] for _ in range(ranks)
        ]
        for g, members in enumerate(groups):
            rank_packs[g % ranks].append(_pack(members, losses, masks, tps, data))
        for packs in rank_packs:
            if not packs:
                packs.append(_pack([], losses, masks, tps, data))
                seen["all-padding pack"] += 1

        for red in REDUCTIONS:
            want = reference(losses, masks, red, tps)
            # all_reduce(SUM) of each rank's local denominator:
            d = sum(
                local_denominator([p[1] for p in packs], red, [p[2] for p in packs])
                for packs in rank_packs
            )
            assert isinstance(d, torch.Tensor)
            got = sum(
                float(reduce_loss(ell, lay, red, m, denominator=d))
                for packs in rank_packs
                for ell, lay, m in packs
            )
            assert got == pytest.approx(want, rel=1e-12, abs=1e-12), red
            # DDP averages over ranks, accumulation over micro-steps: the mean of means.
            naive = (
                sum(
                    sum(float(reduce_loss(ell, lay, red, m)) for ell, lay, m in packs) / len(packs)
                    for packs in rank_packs
                )
                / ranks
            )
            seen[f"mean of means wrong ({red})"] += abs(naive - want) > 1e-6 * max(1.0, abs(want))
        seen["empty step or episode"] += any(
            float(m[i : i + tps].sum()) == 0 for m in masks for i in range(0, len(m), tps)
        )
        seen["several packs"] += len(groups) > 1

    check()
    for red in REDUCTIONS:
        assert seen[f"mean of means wrong ({red})"] > 30, seen
    assert seen["all-padding pack"] > 10 and seen["empty step or episode"] > 10, seen
    assert seen["several packs"] > 50, seen


def _pack(
    members: list[int],
    losses: list[torch.Tensor],
    masks: list[torch.Tensor],
    tps: int,
    data: st.DataObject,
) -> tuple[torch.Tensor, StreamLayout, torch.Tensor]:
    """Concatenate episodes, pad the tail with garbage (NaN losses, mask 1) to a multiple."""
    lengths = [len(losses[e]) for e in members]
    pad = data.draw(st.integers(0 if lengths else 1, 4)) * tps
    lay = _layout(lengths, sum(lengths) + pad, tps)
    loss = torch.cat([*(losses[e] for e in members), torch.full((pad,), NAN, dtype=torch.float64)])
    mask = torch.cat([*(masks[e] for e in members), torch.ones(pad, dtype=torch.float64)])
    return loss, lay, mask


# -- padding, masks and all-padding packs ---------------------------------------------------------
def test_all_padding_pack_contributes_exactly_zero() -> None:
    empty = _layout([], 6)
    w = torch.zeros(6, 3, dtype=torch.float64, requires_grad=True)
    loss = (w**2 + NAN).sum(1)  # NaN on padding (finite derivative), part of the graph
    for red in REDUCTIONS:
        assert local_denominator(empty, red).item() == 0
        d = global_denominator([_layout([2, 4, 3], 9), empty], red)
        assert d.item() == global_denominator([_layout([2, 4, 3], 9)], red).item()
        out = reduce_loss(loss, empty, red, denominator=d)
        assert out.item() == 0.0
    out.backward()  # a rank with no episode still joins backward, with zero gradient
    assert w.grad is not None and bool((w.grad == 0).all())


def test_masked_and_padding_values_cannot_leak() -> None:
    lay = _layout([2, 4, 3], 12)
    mask = torch.tensor([1, 1, 1, 0, 1, 1, 0, 0, 0, 1, 1, 1]).bool()  # episode 2 fully masked
    base = torch.arange(12, dtype=torch.float64)
    poisoned = torch.where(mask & (lay.doc_ids_T >= 0), base, torch.tensor(1e30))
    for red in REDUCTIONS:
        assert torch.equal(reduce_loss(base, lay, red, mask), reduce_loss(poisoned, lay, red, mask))
    # episode 2 has no unmasked token: it is not counted (2 episodes, not 3).
    assert local_denominator(lay, "episode", mask).item() == 2
    assert reduce_loss(base, lay, "episode", mask).item() == pytest.approx(
        (0.5 + (2 + 4 + 5) / 3) / 2
    )


def test_nothing_to_learn_gives_zero_not_nan() -> None:
    lay = _layout([2, 1], 4)
    out = reduce_loss(torch.ones(4), lay, "episode", torch.zeros(4, dtype=torch.bool))
    assert out.item() == 0.0


def test_python_int_and_tensor_denominators_agree() -> None:
    lay = _layout([2, 4, 6], 16, tps=2)
    ones = torch.ones(16, dtype=torch.bool)
    for red in REDUCTIONS:
        assert local_denominator(lay, red).item() == local_denominator(lay, red, ones).item()
        assert (
            local_denominator(lay, red).item()
            == local_denominator(lay.doc_ids_T, red, ones, 2).item()
        )
    assert [local_denominator(lay, r).item() for r in REDUCTIONS] == [12, 6, 3]


def test_errors_name_the_problem_and_the_fix() -> None:
    lay = _layout([2, 4, 3], 12)
    with pytest.raises(ValueError, match="reduction='mean'"):
        token_weights(lay, "mean")  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"loss_mask must be \(T,\) = \(12,\).*batch\['action_loss_mask'\]"
    ):
        token_weights(lay, "token", torch.ones(9))
    with pytest.raises(
        ValueError, match="document 2 has 3 tokens, not a multiple of tokens_per_step=2"
    ):
        token_weights(lay, "frame", tokens_per_step=2)
    with pytest.raises(ValueError, match="tokens_per_step=0 must be >= 1"):
        token_weights(lay.doc_ids_T, "frame", tokens_per_step=0)
    with pytest.raises(ValueError, match="needs tokens_per_step="):
        token_weights(lay.doc_ids_T, "frame")
    with pytest.raises(ValueError, match="loss has 9 rows but the layout has 12 tokens"):
        reduce_loss(torch.ones(9), lay, "token")
    with pytest.raises(ValueError, match="2 layouts but 1 loss masks"):
        local_denominator([lay, lay], "token", [None])
    with pytest.raises(ValueError, match="grad_scale=0"):
        LossNormalizer(reduction="token", denominator=torch.ones(()), grad_scale=0)


# -- with autograd: the normaliser reproduces one episode per micro-step + accumulation ----------
def _episodes(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(x, target, mask) for episodes of lengths [2, 4, 3, 1, 5]; mask = not action_is_pad."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in (2, 4, 3, 1, 5):
        mask = torch.ones(n, dtype=torch.bool)
        mask[-1] = n < 3  # the last action of the longer episodes is padding
        out.append((torch.randn(n, 3, generator=g, dtype=torch.float64),
                    torch.randn(n, 2, generator=g, dtype=torch.float64), mask))  # fmt: skip
    return out


def _grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def _unpacked_grad(model: torch.nn.Module, episodes: list, num_ranks: int = 1) -> torch.Tensor:
    """The baseline: one episode per micro-step, mean over its unmasked tokens, accumulated
    and divided by the number of micro-steps (and averaged over ranks by DDP)."""
    model.zero_grad()
    for x, y, m in episodes:
        per_elem = (model(x) - y) ** 2
        (per_elem[m].mean() / len(episodes)).backward()
    return _grads(model)


def _packs(
    episodes: list, groups: list[list[int]]
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, StreamLayout]]:
    packs = []
    for g in groups:
        xs = [episodes[i][0] for i in g]
        lengths = [len(x) for x in xs]
        pad = 3
        x = torch.cat([*xs, torch.zeros(pad, 3, dtype=torch.float64)])
        y = torch.cat([*(episodes[i][1] for i in g), torch.zeros(pad, 2, dtype=torch.float64)])
        m = torch.cat([*(episodes[i][2] for i in g), torch.ones(pad, dtype=torch.bool)])
        packs.append((x, y, m, _layout(lengths, sum(lengths) + pad)))
    return packs


def test_episode_normalizer_reproduces_one_episode_per_micro_step() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2, dtype=torch.float64)
    episodes = _episodes()
    want = _unpacked_grad(model, episodes)
    packs = _packs(episodes, [[3, 0], [4, 2, 1]])  # 2 micro-steps, order shuffled
    norm = LossNormalizer.for_step([p[3] for p in packs], "episode", [p[2] for p in packs])
    assert norm.grad_scale == 1.0 and norm.denominator.item() == 5
    model.zero_grad()
    for x, y, m, lay in packs:
        norm((model(x) - y) ** 2, lay, m).backward()
    got = _grads(model)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-14)
    # The per-micro-step episode mean, accumulated with / num_micro_steps, is not the same.
    model.zero_grad()
    for x, y, m, lay in packs:
        (reduce_loss((model(x) - y) ** 2, lay, "episode", m) / len(packs)).backward()
    wrong = _grads(model)
    assert not torch.allclose(wrong, want, rtol=1e-3)


def _ddp_worker(rank: int, world: int, init_file: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2, dtype=torch.float64)
        episodes = _episodes()
        want = _unpacked_grad(model, episodes)  # the single-process reference
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        # Rank 0: two micro-steps holding all five episodes. Rank 1: no episode at all.
        packs = _packs(episodes, [[3, 0], [4, 2, 1]]) if rank == 0 else _packs(episodes, [[]])
        norm = LossNormalizer.for_step([p[3] for p in packs], "episode", [p[2] for p in packs])
        assert norm.grad_scale == world and norm.denominator.item() == 5  # all-reduced
        model.zero_grad()
        for i, (x, y, m, lay) in enumerate(packs):
            if i < len(packs) - 1:
                with ddp.no_sync():
                    norm((ddp(x) - y) ** 2, lay, m).backward()
            else:
                norm((ddp(x) - y) ** 2, lay, m).backward()  # DDP averages gradients here
        got = _grads(model)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    finally:
        dist.destroy_process_group()


@pytest.mark.ddp
def test_loss_normalizer_under_real_ddp_with_an_empty_rank() -> None:
    """Two gloo processes; one rank gets no episode. The all-reduced denominator and the
    world-size scale make DDP's averaged gradient equal the one-episode-per-micro-step one."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        # spawn, not fork: a child forked after the parent used OpenMP threads can hang.
        ctx = mp.start_processes(
            _ddp_worker, args=(2, os.path.join(tmp, "init")), nprocs=2, join=False,
            start_method="spawn",
        )  # fmt: skip
        deadline = time.monotonic() + 300
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for proc in ctx.processes:
                    proc.kill()
                pytest.fail("DDP workers did not finish in 300 s (a collective hung)")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_host_device_sync_on_cuda() -> None:
    lay = _layout([2, 4, 3], 12).to("cuda")
    cpu_mask = torch.tensor([1] * 8 + [0] * 4, dtype=torch.bool)  # action_is_pad from the worker
    mask, loss = cpu_mask.cuda(), torch.rand(12, 2, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for red in REDUCTIONS:
            d = local_denominator([lay, lay], red, [mask, cpu_mask], device="cuda")
            reduce_loss(loss, lay, red, mask, denominator=d)
            reduce_loss(loss, lay.doc_ids_T, red, mask, 1, denominator=local_denominator(lay, red))
    finally:
        torch.cuda.set_sync_debug_mode(0)
