"""The one FLOP count (benchmarks/harness/flops.py) against torch's own FLOP counter.

`torch.utils.flop_counter.FlopCounterMode` counts every matmul the tiny reference DiT runs,
forward and backward. With SDPA's math backend attention is two plain matmuls whose backward is
four (the 3x model convention), and one exact-length episode has no padding and no masked
pairs, so the count must agree with it; the old count (K/V on every token) must not.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness.flops import EpisodeShape, attention_flops, dit_flops, mfu
from packing.data import PackedCollator
from packing.model import DiT, DiTConfig

TASK = "x" * 63  # BOS + 63 bytes = 64 text tokens: pack_text pads the text to 64, so no padding


def counted(model: DiT, frames: int, actions: int, *, backward: bool) -> float:
    g = torch.Generator().manual_seed(frames * 100 + actions)
    ep = {"latents": torch.randn(frames, 48, 8, 16, generator=g),
          "action": torch.randn(actions, 14, generator=g), "task": TASK, "episode_index": 0}  # fmt: skip
    batch = PackedCollator(model.streams, pad_to_multiple=1)([ep])
    batch.extras.update(seed=0, step=0)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        out = model(batch)
        if backward:
            (out["latents"].sum() + out["action"].sum()).backward()
    return float(fc.get_total_flops())


@pytest.mark.parametrize("backward", [True, False], ids=["fwd+bwd", "fwd"])
@pytest.mark.parametrize(("frames", "actions"), [(3, 7), (1, 1), (5, 13)])
def test_count_matches_torch_flop_counter_within_2_percent(
    frames: int, actions: int, backward: bool
) -> None:
    torch.manual_seed(0)
    model = DiT(DiTConfig.tiny(attention="sdpa"))
    cfg = model.config
    ep = EpisodeShape(video=frames * cfg.tokens_per_frame, action=actions, text=64)
    ours = dit_flops(cfg, [ep], backward=backward).model
    torch_count = counted(model, frames, actions, backward=backward)
    assert abs(ours / torch_count - 1) < 0.02, (ours, torch_count)


def test_old_count_with_kv_on_every_token_is_caught() -> None:
    # The control: charge the cross-attention K/V to the joint tokens (the old count's bug)
    # on a long episode with few text tokens, and the 2% check above must fail.
    torch.manual_seed(0)
    model = DiT(DiTConfig.tiny(attention="sdpa"))
    cfg = model.config
    ep = EpisodeShape(video=5 * cfg.tokens_per_frame, action=13, text=64)
    right = dit_flops(cfg, [ep]).model
    kv_on_joint = 3.0 * cfg.depth * 2.0 * (ep.joint - ep.text) * 2 * cfg.dim * cfg.dim
    torch_count = counted(model, 5, 13, backward=True)
    assert abs(right / torch_count - 1) < 0.02
    assert abs((right + kv_on_joint) / torch_count - 1) > 0.02


def test_attention_conventions_model_3x_and_hardware_as_torch_counts_a_fused_kernel() -> None:
    # torch counts a fused SDPA backward as 5 matmuls (scores recomputed): 2.5x the forward.
    b, h, s, d = 1, 4, 96, 16
    shape = (b, h, s, d)
    fwd = sdpa_flop_count(shape, shape, shape)
    bwd = sdpa_backward_flop_count(shape, shape, shape, shape)
    kw = dict(heads=h, head_dim=d)
    assert attention_flops([s], **kw) == fwd
    assert attention_flops([s], backward=True, convention="hardware", **kw) == fwd + bwd
    assert attention_flops([s], backward=True, convention="model", **kw) == 3 * fwd
    with pytest.raises(ValueError, match="convention"):
        attention_flops([s], backward=True, convention="paper", **kw)


def test_kv_is_charged_to_text_tokens_and_hardware_count_is_beside_the_model_count() -> None:
    cfg = DiTConfig.wan_2_2_5b(depth=4)
    short_text = dit_flops(cfg, [(7000, 200, 31)])
    long_text = dit_flops(cfg, [(7000, 200, 62)])
    d = cfg.dim
    # 31 more text tokens add their K/V (and text MLP) matmuls, not ones per joint token
    extra_dense = long_text.dense - short_text.dense
    assert extra_dense == pytest.approx(3 * 31 * 2 * 2 * d * d * (cfg.depth + 1))
    assert short_text.hardware - short_text.model == pytest.approx(short_text.attention / 6)


def test_mfu_names_both_peaks() -> None:
    out = mfu(790e12, 1.0)
    assert out == {"MFU of measured 790": 1.0, "MFU of datasheet 989": pytest.approx(790 / 989)}


# -- LingBot-VA (LeRobot's dual-stream transformer) -------------------------------------------
def _lingbot_count(frames: int, chunk: int, window: int, *, backward: bool) -> tuple[float, Any]:
    """FlopCounterMode over the benchmark's lean LingBot-VA forward (+ backward) of one exact
    episode on LeRobot's tiny transformer, attention through SDPA's math backend with the
    dense mask (all T x T pairs multiplied, as the count's ``pairs = joint²`` says)."""
    pytest.importorskip("lerobot.policies.lingbot_va.utils")
    from benchmarks.lingbot import common as lb

    cfg = lb.TINY
    model = lb.build_model(cfg, 2, torch.device("cpu"), 0)
    lb.swap_attention(model)
    ep = lb.make_episode(0, frames, cfg, lb.TINY_HW, 0)
    ep = lb.Episode(**{**ep.__dict__, "chunk": chunk, "window": window})
    lay = lb.layout([ep], lb.TINY_HW, pad_to=1)
    inp = lb.noise_inputs([ep], lb.loss_holder((1, 2, 2)), lb.action_mask(cfg, torch.device("cpu")),
                          text_slots=lb.TEXT_LEN)  # fmt: skip
    lb.MASKS.self_attend = lb.MASKS.cross_attend = lb.sdpa
    lb.MASKS.self_mask, lb.MASKS.cross_mask = lb.dense_lingbot_mask(lay), None
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        loss = lb.lean_loss(model, inp, lay, lb.blocks_runner(model, checkpointing=False))
        if backward:
            loss.backward()
    return float(fc.get_total_flops()), (cfg, ep, lay)


@pytest.mark.parametrize("backward", [True, False], ids=["fwd+bwd", "fwd"])
@pytest.mark.parametrize(("frames", "chunk", "window"), [(5, 2, 4), (3, 1, 64)])
def test_lingbot_count_matches_torch_flop_counter_within_2_percent(
    frames: int, chunk: int, window: int, backward: bool
) -> None:
    from benchmarks.harness.flops import LingbotEpisode, lingbot_flops

    counted_, (cfg, _ep, lay) = _lingbot_count(frames, chunk, window, backward=backward)
    shape = LingbotEpisode(frames=frames, tokens_per_frame=4, pairs=float(lay.T * lay.T))
    ours = lingbot_flops({**cfg, "num_layers": 2}, [shape], backward=backward).model
    assert abs(ours / counted_ - 1) < 0.02, (ours, counted_)
    # the control: LeRobot's per-token timestep MLP is not what this forward runs
    per_token = lingbot_flops({**cfg, "num_layers": 2}, [shape], backward=backward,
                              per_token_conditioning=True).model  # fmt: skip
    assert abs(per_token / counted_ - 1) > 0.02


def test_lingbot_mask_pairs_are_the_dense_mask_count() -> None:
    # mask_pairs counts over (copy, stream, frame) groups; the dense T x T mask is the truth
    pytest.importorskip("lerobot.policies.lingbot_va.utils")
    from benchmarks.lingbot import common as lb

    seen = set()
    for frames, chunk, window in [(7, 3, 4), (5, 1, 64), (9, 4, 5), (1, 2, 4)]:
        ep = lb.make_episode(1, frames, lb.TINY, lb.TINY_HW, 0)
        ep = lb.Episode(**{**ep.__dict__, "chunk": chunk, "window": window})
        lay = lb.layout([ep], lb.TINY_HW, pad_to=1)
        dense = int(lb.dense_lingbot_mask(lay).sum())
        assert lb.mask_pairs(ep, lb.TINY_HW) == dense
        seen.add(dense < lay.T * lay.T)
    assert seen == {True}  # every case masks some pairs: the window and the chunks bite
