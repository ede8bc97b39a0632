"""`packing verify`'s harness: it passes a correct packed model and fails every packing mistake.

The harness is first exercised on a small test-local model (one attention layer over actions,
adaLN from a per-episode timestep), then on the shipped reference model over the embedded
default dataset (the README's main command) and on each mistake of docs/porting.md.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from packing.attention import packed_attention, prepare_attention
from packing.data import PackedBatch, PackedCollator, Stream
from packing.train import (
    broadcast_to_tokens,
    episode_timesteps,
    flow_matching_inputs,
    packed_noise,
)
from packing.verify import compare_packed_unpacked
from packing.verify._command import default_token_budget
from packing.verify._report import Tolerances, cosine_similarity, relative_difference

A = 6  # action dim


class ToyActionModel(nn.Module):
    """Flow matching on actions: per-episode t -> adaLN, one document-masked attention layer.

    Switches inject the porting mistakes: ``global_rng`` (noise from torch.randn),
    ``document_mask=False``, ``global_positions`` (a position embedding from the position in
    the pack instead of in the episode), ``per_token_conditioning`` (correct, just slower).
    """

    streams = (Stream("action"),)

    def __init__(
        self,
        *,
        document_mask: bool = True,
        global_rng: bool = False,
        global_positions: bool = False,
        per_token_conditioning: bool = False,
        dim: int = 16,
    ) -> None:
        super().__init__()
        self.document_mask = document_mask
        self.global_rng = global_rng
        self.global_positions = global_positions
        self.per_token_conditioning = per_token_conditioning
        self.inp = nn.Linear(A, dim)
        self.pos = nn.Embedding(512, dim)
        self.cond = nn.Sequential(nn.Linear(1, dim), nn.SiLU(), nn.Linear(dim, 2 * dim))
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, A)

    def forward(self, batch: PackedBatch) -> dict[str, torch.Tensor]:
        lay = batch.layout("action")
        x0 = batch["action"].float()
        seed, step = batch.extras["seed"], batch.extras["step"]
        t_K = episode_timesteps(seed, step, batch.episode_ids)
        t_T = broadcast_to_tokens(t_K, lay)
        if self.global_rng:
            noise = torch.randn_like(x0) * (lay.doc_ids_T >= 0)[:, None]
        else:
            noise = packed_noise(batch, seed=seed, step=step, stream="action")
        xt, target = flow_matching_inputs(x0, noise, t_T)
        if self.per_token_conditioning:
            mod = self.cond(t_T[:, None])
        else:
            mod = broadcast_to_tokens(self.cond(t_K[:, None]), lay)
        scale, shift = mod.chunk(2, dim=-1)
        pos = torch.arange(lay.padded_len) if self.global_positions else lay.position_ids_T.long()
        h = (self.inp(xt) + self.pos(pos)) * (1 + scale) + shift
        if self.document_mask:
            mask = prepare_attention(lay, backend="sdpa")
        else:  # every real token in one document: episodes see each other
            one = torch.where(lay.doc_ids_T >= 0, 0, -1).to(lay.doc_ids_T.dtype)
            from dataclasses import replace

            mask = prepare_attention(
                replace(lay, doc_ids_T=one, lengths_K=(lay.num_tokens,), steps_K=(lay.num_tokens,)),
                backend="sdpa",
            )
        q, k, v = self.qkv(h).unflatten(-1, (3, 2, -1)).unbind(1)
        h = h + packed_attention(q, k, v, mask).flatten(1)
        loss = (self.out(h) - target).pow(2).mean(-1)
        return {"action": torch.where(lay.doc_ids_T >= 0, loss, 0.0)}


def _episodes(lengths: list[int]) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    return [
        {"action": torch.randn(n, A, generator=gen), "episode_index": 100 + e}
        for e, n in enumerate(lengths)
    ]


LENGTHS = [23, 1, 40, 7, 17, 29, 3]
PACKS = [[2, 3, 1], [5, 4], [0, 6]]


def _compare(model: nn.Module, **kw):
    torch.manual_seed(0)
    return compare_packed_unpacked(
        model,
        _episodes(LENGTHS),
        collate_unpacked=PackedCollator([Stream("action")], pad_to_multiple=16),
        collate_packed=PackedCollator([Stream("action")], token_budget=64),
        packs=PACKS,
        steps=kw.pop("steps", 3),
        **kw,
    )


# -- metrics ------------------------------------------------------------------------------------
def test_relative_difference_is_max_abs_over_max_ref() -> None:
    b = torch.tensor([1.0, -4.0, 2.0])
    a = torch.tensor([1.0, -4.0, 2.2])
    assert relative_difference(a, b) == pytest.approx(0.2 / 4.0)
    assert relative_difference(torch.zeros(3), torch.zeros(3)) == 0.0
    assert relative_difference(torch.ones(3), torch.zeros(3)) == math.inf
    assert relative_difference(torch.tensor([math.nan]), torch.ones(1)) == math.inf


def test_cosine_similarity() -> None:
    assert cosine_similarity(torch.tensor([1.0, 0.0]), torch.tensor([2.0, 0.0])) == 1.0
    assert cosine_similarity(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 3.0])) == 0.0
    assert cosine_similarity(torch.zeros(2), torch.zeros(2)) == 1.0


def test_tolerances_depend_on_dtype() -> None:
    fp32 = Tolerances.for_dtype(torch.float32)
    assert (fp32.loss_rel, fp32.grad_rel, fp32.param_rel) == (1e-6, 1e-5, 1e-5)
    bf16 = Tolerances.for_dtype(torch.bfloat16)
    assert (bf16.loss_rel, bf16.grad_cos, bf16.grad_rel, bf16.param_rel) == (
        5e-3,
        0.999,
        None,
        None,
    )
    with pytest.raises(ValueError, match="no tolerances for dtype"):
        Tolerances.for_dtype(torch.float64)


def test_default_token_budget() -> None:
    assert default_token_budget([160, 64, 288, 96]) == 288
    assert default_token_budget([32 * f for f in (5, 2, 9, 3, 7, 4, 8, 2, 6, 9, 3, 5)]) == 768
    assert default_token_budget([1000, 10]) == 1024
    assert default_token_budget([5, 2, 9, 3, 7]) == 16
    # Three episodes whose third is below the longest: the two shortest must share a pack.
    assert default_token_budget([45, 60, 30]) == 80


def test_a_given_budget_that_holds_one_episode_a_pack_names_the_budget_to_give() -> None:
    from packing.verify._command import token_budget

    assert token_budget([45, 60, 30], 15, 75, leak_check=True) == 75
    with pytest.raises(ValueError, match=r"--token-budget 60 holds one episode a pack .*"
                       r"pass --token-budget 75 or more"):  # fmt: skip
        token_budget([45, 60, 30], 15, 60, leak_check=True)
    assert token_budget([45, 60, 30], 15, 60) == 60  # --no-leak-check: the user's call


# -- the harness on a correct model -------------------------------------------------------------
def test_correct_packed_model_passes_with_margin() -> None:
    report = _compare(ToyActionModel())
    assert report.passed, report.format()
    # Not vacuous: training moved the weights, the losses are not trivially equal, packs
    # really held several episodes, and every parameter got a gradient compared.
    assert report.packs == 3 and report.pack_sizes == [3, 2, 2]
    assert [s.micro_steps_unpacked for s in report.steps] == [7, 7, 7]
    assert len({round(s.loss_unpacked, 6) for s in report.steps}) == 3
    assert len(report.grads) == len(list(ToyActionModel().parameters()))
    assert report.loss_rel <= 1e-6
    assert max(g.rel for g in report.grads) <= 1e-5
    assert report.param_rel <= 1e-5
    assert report.leak is not None and report.leak.ok and report.leak.num_docs == 3
    assert report.tokens == sum(LENGTHS)
    text = report.format()
    assert "PASS" in text and "| step |" in text
    assert report.to_dict()["passed"] is True


def test_per_token_conditioning_is_slow_not_wrong() -> None:
    report = _compare(ToyActionModel(per_token_conditioning=True), leak_check=False)
    assert report.passed, report.format()


@pytest.mark.parametrize("reduction", ["token", "frame", "episode"])
def test_every_reduction_is_exact(reduction: str) -> None:
    report = _compare(ToyActionModel(), reduction=reduction, steps=1, leak_check=False)
    assert report.passed, report.format()


# -- the mistakes -------------------------------------------------------------------------------
def test_no_document_mask_fails_and_names_the_leak() -> None:
    report = _compare(ToyActionModel(document_mask=False))
    assert not report.passed
    assert report.leak is not None and not report.leak.ok
    assert any("leak" in f for f in report.failures)
    assert any("loss differs" in f for f in report.failures)
    assert "FAIL" in report.format()


def test_global_rng_noise_fails() -> None:
    report = _compare(ToyActionModel(global_rng=True), leak_check=False, steps=1)
    assert not report.passed
    assert report.loss_rel > 1e-3


def test_positions_not_reset_per_episode_fails() -> None:
    report = _compare(ToyActionModel(global_positions=True))
    assert not report.passed
    assert report.loss_rel > 1e-6
    # No leak: each episode still sees only itself; it is the positions that are wrong.
    assert report.leak is not None and report.leak.ok


def test_mean_of_means_normaliser_fails() -> None:
    report = _compare(ToyActionModel(), normalise="per-micro-step", leak_check=False, steps=1)
    assert not report.passed
    assert report.loss_rel > 1e-3


class _MisKeyed(ToyActionModel):
    def __init__(self, key: str, rows_delta: int = 0) -> None:
        super().__init__()
        self.key, self.rows_delta = key, rows_delta

    def forward(self, batch: PackedBatch) -> dict[str, torch.Tensor]:
        loss = super().forward(batch)["action"]
        return {self.key: torch.cat([loss, loss.new_zeros(self.rows_delta)])}


def test_a_model_loss_not_per_token_of_a_stream_is_refused_with_the_fix() -> None:
    # A loss keyed by a name that is no stream, or one row per something other than a token,
    # would otherwise be reduced against the wrong layout.
    with pytest.raises(ValueError, match=r"loss 'loss' is keyed.*key per-token losses by stream"):
        _compare(_MisKeyed("loss"), steps=1, leak_check=False)
    with pytest.raises(ValueError, match=r"loss 'action' has \d+ rows but stream 'action' has"):
        _compare(_MisKeyed("action", rows_delta=3), steps=1, leak_check=False)


def test_packs_must_cover_every_episode_once() -> None:
    with pytest.raises(ValueError, match="exactly once"):
        compare_packed_unpacked(
            ToyActionModel(),
            _episodes([3, 4]),
            collate_unpacked=PackedCollator([Stream("action")]),
            collate_packed=PackedCollator([Stream("action")]),
            packs=[[0]],
        )


# -- the reference model on the embedded default dataset ------------------------------------------
@pytest.fixture(scope="module")
def default_episodes() -> list[dict]:
    """The first five episodes of the embedded dataset, through the user's loading path."""
    from packing.datasets import LeRobotEpisodes, default_dataset_root

    ds = LeRobotEpisodes(default_dataset_root(), keys=["latents", "action"])
    return [ds[i] for i in range(5)]  # 5, 2, 9, 3, 7 latent frames


def _small_dit(**overrides):
    from packing.model import DiT, DiTConfig

    torch.manual_seed(0)
    small = dict(dim=32, heads=2, depth=1, ffn_dim=64, freq_dim=32, text_len=16)
    return DiT(DiTConfig.tiny(**{**small, **overrides}))


def _compare_dit(model: nn.Module, episodes: list[dict], **kw):
    from packing.planning import plan_packs

    budget = 384
    lengths = [e["latents"].shape[0] * 32 for e in episodes]
    packs = plan_packs(lengths, budget).packs
    assert max(len(p) for p in packs) >= 2  # guard: some pack really holds several episodes
    return compare_packed_unpacked(
        model,
        episodes,
        collate_unpacked=PackedCollator(model.streams),
        collate_packed=PackedCollator(model.streams, token_budget=budget),
        packs=packs,
        steps=kw.pop("steps", 2),
        **kw,
    )


def test_reference_dit_passes(default_episodes: list[dict]) -> None:
    report = _compare_dit(_small_dit(), default_episodes)
    assert report.passed, report.format()
    assert report.leak is not None and report.leak.ok
    assert report.leak.inputs == ("latents", "action")


def test_reference_dit_frame_causal_passes(default_episodes: list[dict]) -> None:
    report = _compare_dit(_small_dit(frame_causal=True), default_episodes, leak_check=False)
    assert report.passed, report.format()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_dit_without_document_mask_fails(
    default_episodes: list[dict], dtype: torch.dtype
) -> None:
    report = _compare_dit(_small_dit(document_mask=False), default_episodes, steps=1, dtype=dtype)
    assert not report.passed
    # The leak check is bit-exact on CPU in bf16 too, so it names the pairs in both dtypes.
    assert report.leak is not None and report.leak.pairs
    assert any("leak" in f for f in report.failures)


def test_reference_dit_with_global_rng_noise_fails(
    default_episodes: list[dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    import packing.model._dit

    def global_noise(batch, *, seed, step, stream, dtype=None, **_):
        x = batch.streams[stream]
        return torch.randn(x.shape, dtype=dtype or torch.float32)  # the mistake

    monkeypatch.setattr(packing.model._dit, "packed_noise", global_noise)
    report = _compare_dit(_small_dit(), default_episodes, leak_check=False, steps=1)
    assert not report.passed
    assert report.loss_rel > 1e-3


class GlobalPositions(nn.Module):
    """Wraps a packed model and hands it positions that run on across the pack (the mistake):
    1D positions are the index in the pack, (t, h, w) counts frames from the pack's start."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.streams = inner.streams

    @staticmethod
    def _global(batch: PackedBatch) -> PackedBatch:
        from dataclasses import replace

        layouts = {}
        for name, lay in batch.layouts.items():
            pos = torch.arange(lay.padded_len, dtype=lay.position_ids_T.dtype)
            thw = None
            if lay.thw_T3 is not None:
                thw = lay.thw_T3.clone()
                thw[:, 0] = pos // lay.tokens_per_step
            layouts[name] = replace(lay, position_ids_T=pos, thw_T3=thw)
        return replace(batch, layouts=layouts, joint_layouts={})

    def forward(self, batch: PackedBatch) -> dict[str, torch.Tensor]:
        return self.inner(self._global(batch))

    def predict(self, batch: PackedBatch) -> dict[str, torch.Tensor]:
        return self.inner.predict(self._global(batch))


def _camera_rate_actions(episodes: list[dict]) -> list[dict]:
    """Actions at the camera rate, before the VAE's 4x temporal compression: 4F - 3 actions for
    F latent frames, so the action-per-frame ratio changes with the episode's length."""
    return [
        {**e, "action": e["action"].repeat_interleave(4, dim=0)[: 4 * len(e["action"]) - 3]}
        for e in episodes
    ]


def test_reference_dit_with_positions_not_reset_fails(default_episodes: list[dict]) -> None:
    episodes = _camera_rate_actions(default_episodes)
    assert _compare_dit(_small_dit(), episodes, leak_check=False, steps=1).passed  # data fine
    report = _compare_dit(GlobalPositions(_small_dit()), episodes, steps=1)
    assert not report.passed
    assert report.loss_rel > 1e-6
    # Not a leak: each episode still sees only itself; its positions are what changed.
    assert report.leak is not None and report.leak.ok


def test_rope_alone_hides_a_common_position_offset(default_episodes: list[dict]) -> None:
    """With one action per latent frame, video and action positions run on by the same amount,
    and RoPE only sees differences of positions: the mistake is invisible (docs/porting.md)."""
    report = _compare_dit(
        GlobalPositions(_small_dit()), default_episodes, leak_check=False, steps=1
    )
    assert report.passed, report.format()


def test_reference_dit_with_mean_of_means_fails(default_episodes: list[dict]) -> None:
    report = _compare_dit(
        _small_dit(), default_episodes, normalise="per-micro-step", leak_check=False, steps=1
    )
    assert not report.passed
    assert report.loss_rel > 1e-3


def test_reference_dit_bf16_autocast_meets_the_bf16_tolerances(
    default_episodes: list[dict],
) -> None:
    report = _compare_dit(_small_dit(), default_episodes, dtype=torch.bfloat16, leak_check=False)
    assert report.tolerances == Tolerances.for_dtype(torch.bfloat16)
    assert report.passed, report.format()
    assert report.loss_rel > 0  # bf16 really ran: not bit-identical
