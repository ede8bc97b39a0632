"""The leak detector: a leak-free packed model passes, every kind of injected leak is named."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from torch import nn

from packing.data import PackedBatch, Stream, pack
from packing.verify._leak import PADDING, assert_no_leaks, find_leaks

DIM = 8


def _episodes(steps: list[int]) -> list[dict]:
    """Ragged episodes whose values encode identity (100 * episode + t) plus a small jitter."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for e, n in enumerate(steps):
        base = (100.0 * e + torch.arange(n, dtype=torch.float32)).unsqueeze(1) / 100.0
        out.append(
            {
                "x": base + 0.1 * torch.randn(n, DIM, generator=gen),
                "episode_index": 10 + e,
            }
        )
    return out


def _batch(steps: list[int] = [5, 1, 9, 3]) -> PackedBatch:  # noqa: B006
    return pack(_episodes(steps), streams=[Stream("x")], pad_to_multiple=8)


def _mask(doc: torch.Tensor) -> torch.Tensor:
    """Dense document mask: same doc, and a padding token (-1) sees only itself."""
    same = doc[:, None] == doc[None, :]
    eye = torch.eye(doc.shape[0], dtype=torch.bool)
    return torch.where((doc < 0)[:, None], eye, same)


class DocAttention(nn.Module):
    """One attention layer over the packed stream, restricted by the document mask."""

    def __init__(self, document_mask: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)
        self.document_mask = document_mask

    def forward(self, batch: PackedBatch) -> dict[str, torch.Tensor]:
        x = batch["x"]
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        mask = _mask(batch["doc_ids"]) if self.document_mask else None
        y = nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask)[0]
        return {"x": self.out(torch.nn.functional.layer_norm(y + x, (DIM,)))}


class GlobalPool(DocAttention):
    """The classic silent leak: a mean over the whole pack (e.g. a 'global' conditioning)."""

    def forward(self, batch: PackedBatch) -> dict[str, torch.Tensor]:
        y = super().forward(batch)["x"]
        return {"x": y + y.mean(dim=0, keepdim=True)}


class _BackwardOnlyLeak(torch.autograd.Function):
    """Identity forward; the backward adds a pack-mean that depends on every episode.

    A wrong custom kernel in miniature: outputs are clean, only gradients mix episodes.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return g + (x * g).mean(dim=0, keepdim=True)


class BackwardLeak(DocAttention):
    def forward(self, batch: PackedBatch) -> dict[str, torch.Tensor]:
        y = super().forward(batch)["x"]
        return {"x": _BackwardOnlyLeak.apply(y)}


def test_document_masked_attention_has_no_leak() -> None:
    batch = _batch()
    report = find_leaks(DocAttention(), batch)
    assert report.ok, report.summary()
    # Not vacuous: every doc was perturbed (plus the padding tail) and compared with the others.
    assert report.num_docs == 4
    assert report.perturbations == 4 + 1
    assert report.comparisons == (4 * 3 + 4) * (1 + 1)  # (pairs + padding->docs) x (out, grad)
    assert report.episode_index == (10, 11, 12, 13)


def test_no_document_mask_is_caught_for_every_pair() -> None:
    report = find_leaks(DocAttention(document_mask=False), _batch())
    assert not report.ok
    pairs = {(i, j) for i, j in report.pairs if j != PADDING}
    assert pairs == {(i, j) for i in range(4) for j in range(4) if i != j}
    # Padding leaks into real docs too when nothing masks it.
    assert any(j == PADDING for _, j in report.pairs)
    assert {lk.kind for lk in report.leaks} == {"output", "gradient"}
    with pytest.raises(AssertionError, match=r"episode 11\).*changed output 'x' of doc"):
        report.raise_if_leaking()


def test_global_mean_pool_is_caught() -> None:
    report = find_leaks(GlobalPool(), _batch([3, 7, 2]))
    assert not report.ok
    assert {(i, j) for i, j in report.pairs if j != PADDING} == {
        (i, j) for i in range(3) for j in range(3) if i != j
    }
    assert report.leaks[0].input_stream == "x"
    assert "LEAKS" in report.summary()


def test_backward_only_leak_is_caught_by_the_gradient_check() -> None:
    batch = _batch([4, 2, 6])
    report = find_leaks(BackwardLeak(), batch)
    assert not report.ok
    assert {lk.kind for lk in report.leaks} == {"gradient"}
    # Without the gradient check the same model looks clean: the check is what catches it.
    assert find_leaks(BackwardLeak(), batch, gradients=False).ok


def test_one_bit_of_leak_is_caught() -> None:
    """Bit-exact comparison: a leak a millionth the size of the output still fails."""

    class Tiny(DocAttention):
        def forward(self, batch: PackedBatch) -> dict[str, torch.Tensor]:
            y = super().forward(batch)["x"]
            return {"x": y + 1e-6 * batch["x"].sum()}

    report = find_leaks(Tiny(), _batch([2, 3]), gradients=False, padding=False)
    assert report.pairs == [(0, 1), (1, 0)]
    assert max(lk.max_abs_diff for lk in report.leaks) < 1e-4
    assert "padding was not perturbed" in report.notes


def test_assert_no_leaks_passes_and_returns_the_report() -> None:
    report = assert_no_leaks(DocAttention(), _batch([1, 2]))
    assert report.ok and report.num_docs == 2


def test_non_deterministic_fn_is_refused() -> None:
    model = DocAttention()

    def noisy(batch: PackedBatch) -> dict[str, torch.Tensor]:
        return {"x": model(batch)["x"] + torch.randn(())}

    with pytest.raises(ValueError, match=r"not deterministic.*global RNG"):
        find_leaks(noisy, _batch())


def test_errors_name_the_fix() -> None:
    with pytest.raises(ValueError, match=">= 2 episodes"):
        find_leaks(DocAttention(), _batch([4]))
    with pytest.raises(ValueError, match="output_layouts="):
        find_leaks(lambda b: {"y": torch.zeros(b.layout().padded_len)}, _batch())
    with pytest.raises(ValueError, match=r"output 'x' has 3 rows but stream 'x' has \d+ tokens"):
        find_leaks(lambda b: {"x": torch.zeros(3)}, _batch())
    with pytest.raises(KeyError, match="'nope' is not a stream"):
        find_leaks(DocAttention(), _batch(), inputs=["nope"])


def test_rtol_ignores_noise_below_the_threshold_but_not_a_leak() -> None:
    """A tiny cross-episode term passes under rtol; a real leak (no mask) still fails."""

    class Tiny(DocAttention):
        def forward(self, batch: PackedBatch) -> dict[str, torch.Tensor]:
            y = super().forward(batch)["x"]
            return {"x": y + 1e-6 * batch["x"].sum()}

    batch = _batch([2, 3, 4])
    assert not find_leaks(Tiny(), batch, gradients=False).ok
    assert find_leaks(Tiny(), batch, gradients=False, rtol=1e-2).ok
    assert not find_leaks(DocAttention(document_mask=False), batch, rtol=1e-2).ok


def test_noise_floor_is_measured_and_zero_for_a_deterministic_fn() -> None:
    """noise_floor scales the run-to-run noise; deterministic kernels keep the check exact."""

    class Tiny(DocAttention):
        def forward(self, batch: PackedBatch) -> dict[str, torch.Tensor]:
            y = super().forward(batch)["x"]
            return {"x": y + 1e-6 * batch["x"].sum()}

    report = find_leaks(Tiny(), _batch([2, 3, 4]), gradients=False, noise_floor=10.0)
    assert not report.ok
    assert not any("run-to-run noise" in n for n in report.notes), report.notes


class _DeterminismSpy(torch.autograd.Function):
    """Identity that records torch's determinism switch in its forward and its backward."""

    seen: ClassVar[list[tuple[str, bool]]] = []

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        _DeterminismSpy.seen.append(("fwd", torch.are_deterministic_algorithms_enabled()))
        return x.clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        _DeterminismSpy.seen.append(("bwd", torch.are_deterministic_algorithms_enabled()))
        return g


@pytest.mark.parametrize("deterministic", [True, False])
def test_fn_and_its_backward_run_under_torchs_determinism_switch(deterministic: bool) -> None:
    # On an H200, FA4's atomic dQ gave two identical clean runs, then flipped one bf16 ulp of
    # episode 0's gradient when episode 1 was perturbed: reported as a leak. Kernels with a
    # deterministic mode (FA4's backward through packing.attention._packed) use it during the check.
    class Spy(DocAttention):
        def forward(self, batch: PackedBatch) -> dict[str, torch.Tensor]:
            return {"x": _DeterminismSpy.apply(super().forward(batch)["x"])}

    _DeterminismSpy.seen.clear()
    report = find_leaks(Spy(), _batch([2, 3, 4]), deterministic=deterministic)
    assert report.ok, report.summary()
    kinds = {k for k, _ in _DeterminismSpy.seen}
    assert kinds == {"fwd", "bwd"}
    clean_and_perturbed = [on for k, on in _DeterminismSpy.seen if k == "bwd"]
    assert clean_and_perturbed == [deterministic] * len(clean_and_perturbed)
    assert not torch.are_deterministic_algorithms_enabled()  # restored afterwards


def _reference_pack(document_mask: bool = True):
    from packing.datasets import LeRobotEpisodes, default_dataset_root
    from packing.model import DiT, DiTConfig

    torch.manual_seed(0)
    cfg = dict(dim=32, heads=2, depth=1, ffn_dim=64, freq_dim=32, text_len=16)
    model = DiT(DiTConfig.tiny(document_mask=document_mask, **cfg)).eval()
    ds = LeRobotEpisodes(default_dataset_root(), keys=["latents", "action"])
    batch = pack([ds[i] for i in (1, 3, 0)], streams=model.streams)  # 2, 3, 5 frames
    batch.extras.update(seed=0, step=0)
    return model, batch


def test_reference_dit_has_no_leak_in_predictions_or_losses() -> None:
    model, batch = _reference_pack()
    report = find_leaks(model.predict, batch)
    assert report.ok, report.summary()
    assert report.inputs == ("latents", "action") and report.outputs == ("latents", "action")
    assert report.num_docs == 3 and report.episode_index == (1, 3, 0)
    assert find_leaks(model, batch, gradients=False).ok  # the per-token losses too


def test_reference_dit_without_document_mask_leaks_between_every_pair() -> None:
    model, batch = _reference_pack(document_mask=False)
    report = find_leaks(model.predict, batch, padding=False)
    assert {(i, j) for i, j in report.pairs} == {
        (i, j) for i in range(3) for j in range(3) if i != j
    }
    # Named by stream: video perturbations reach the actions of other episodes, and back.
    assert {(lk.input_stream, lk.output) for lk in report.leaks if lk.kind == "output"} == {
        ("latents", "latents"),
        ("latents", "action"),
        ("action", "latents"),
        ("action", "action"),
    }
