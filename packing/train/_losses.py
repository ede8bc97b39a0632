"""Loss reductions that are exact under packing, gradient accumulation and data parallelism.

Reduce by SUM with per-token weights, then divide by ONE global denominator known before the
first backward of the optimizer step::

    loss_step = sum over ranks r, micro-steps m, tokens i of  w_i * loss_i   /   D
    D         = sum over ranks and micro-steps of  local_denominator(...)   (one all_reduce)

Three reductions (``loss_i`` is the per-token loss; a ``(T, D)`` loss is first averaged over
``D`` -- and over any further trailing dims -- so a token's loss is the mean of its channels,
as ``F.mse_loss(reduction="mean")`` weighs them; ``m_i`` is the loss mask, 0 on padding)::

    "token"    every real unmasked token weighs the same     w_i = m_i               D = sum m_i
    "frame"    every step (frame) weighs the same; a step's  w_i = m_i / sum_step m  D = #steps
    ("step")   tokens are averaged first (tokens_per_step)
    "episode"  every episode weighs the same, whatever its   w_i = m_i / sum_ep m    D = #episodes
               length: mean over its tokens, then over episodes

A step or episode whose tokens are all masked weighs nothing and is not counted in ``D``.
Worked example, lengths ``[2, 4, 3]``, the last token of episode 2 padding (LeRobot's
``action_is_pad``; the adapters serve its inverse as ``batch["action_loss_mask"]``)::

    doc_ids   0  0 | 1  1  1  1 | 2  2  2
    loss      1  3 | 2  4  6  8 | 3  9  100
    mask      1  1 | 1  1  1  1 | 1  1  0
    token     36 / 8 = 4.5
    episode   (2 + 5 + 6) / 3 = 4.333
    pack A = episodes 0, 1 and pack B = episode 2 on two micro-steps, each with its own mean,
    then averaged ("mean of means"): (24/6 + 12/2) / 2 = 5  -- neither of the above.

Which normaliser reproduces what:

- ``"episode"`` reproduces **one episode per micro-step + gradient accumulation** (and DP):
  there each micro-step's loss is the mean over that episode's tokens, the accumulated
  gradient is divided by the number of micro-steps, and DDP averages over ranks, so the
  optimizer sees the mean over episodes of per-episode means -- exactly this reduction. It
  stays exact however episodes are split into packs, micro-steps and ranks, because each
  episode lies whole in one pack (an episode split across packs would count twice).
- ``"token"`` reproduces a padded batch with a mean over all real tokens, and the global
  token mean of HF ``num_items_in_batch`` / torchtune (long episodes weigh more).
- ``"frame"`` makes each frame weigh the same; it equals ``"token"`` when every step has
  the same number of unmasked tokens (always for ``tokens_per_step=1`` without a mask).

None of them is a per-micro-batch mean: averaging per-pack means (over micro-steps with
accumulation, or over ranks through DDP's gradient averaging) weighs a pack of short episodes
like a pack of long ones, so it changes with how the episodes were packed.

Under accumulation, ``D`` sums every micro-step of the optimizer step (fetch the micro-batches
first, as HF's trainer does). Under DP, ``D`` is all-reduced once per optimizer step (a 0-d
float64 tensor), and because DDP/FSDP *average* gradients over the W ranks, each rank's loss
is multiplied by W (``LossNormalizer`` does both). Without a loss mask ``D`` comes from the
layouts' Python-int lengths; with one it is a device tensor sum -- neither needs a host sync.
An all-padding pack (a rank that got no episode) contributes exactly 0 to the loss and to
``D``; still call ``backward`` on it so the rank joins DDP's gradient all-reduce.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from packing._layout_math import ceil_div, check_doc_runs, doc_starts
from packing._validate import (
    check_bool,
    check_doc_ids,
    check_optional_int,
    check_real,
    check_sequence,
)
from packing.data import StreamLayout

__all__ = [
    "LossNormalizer",
    "Reduction",
    "global_denominator",
    "local_denominator",
    "reduce_loss",
    "token_weights",
]

Reduction = Literal["token", "frame", "step", "episode"]
LayoutLike = StreamLayout | torch.Tensor


def _reduction(reduction: str) -> str:
    if reduction == "step":
        return "frame"
    if reduction not in ("token", "frame", "episode"):
        raise ValueError(
            f"reduction={reduction!r}; choose 'token', 'frame' (alias 'step') or 'episode'"
        )
    return reduction


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Move without a host sync: host-to-device copies are non-blocking (staged); a copy *to*
    the host stays blocking, since its value is read right away."""
    return t.to(device, non_blocking=device.type != "cpu")


def _doc_ids(layout: LayoutLike) -> torch.Tensor:
    if isinstance(layout, StreamLayout):
        return layout.doc_ids_T
    if not isinstance(layout, torch.Tensor):
        raise TypeError(
            f"layout must be a StreamLayout or a (T,) tensor of doc ids, got "
            f"{type(layout).__name__}; pass batch.layout(stream) or batch['doc_ids']"
        )
    ids = check_doc_ids("doc_ids", layout)
    if ids.dim() != 1:
        raise ValueError(f"doc_ids must be (T,), got shape {tuple(ids.shape)}")
    if ids.device.type == "cpu" and ids.numel() and not torch.compiler.is_compiling():
        # Each document one contiguous run, ids increasing, as make_block_mask requires:
        # [0, 0, 1, 1, 0, 0] would count three episodes here and be refused there. Host
        # tensors only (reading device ids would be a sync).
        check_doc_runs(ids, "doc_ids")
    return ids


def _tokens_per_step(layout: LayoutLike, reduction: str, tokens_per_step: int | None) -> int:
    check_optional_int("tokens_per_step", tokens_per_step, min=1, hint="tokens per frame")
    if isinstance(layout, StreamLayout):
        tps = layout.tokens_per_step if tokens_per_step is None else tokens_per_step
        if reduction == "frame":
            for k, n in enumerate(layout.lengths_K):
                if n % tps:
                    raise ValueError(
                        f"frame reduction: document {k} has {n} tokens, not a multiple of "
                        f"tokens_per_step={tps}; pass the layout of the stream this loss is on"
                    )
        return tps
    if tokens_per_step is None:
        if reduction == "frame":
            raise ValueError(
                "frame reduction over raw doc_ids needs tokens_per_step=<tokens per frame>; "
                "or pass the StreamLayout"
            )
        return 1
    return tokens_per_step


def _mask(
    doc_ids_T: torch.Tensor, loss_mask: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """Per-token mass m_i: the loss mask (bool, or float weights) times "is a real token"."""
    real = (doc_ids_T >= 0).to(dtype)
    if loss_mask is not None and not isinstance(loss_mask, torch.Tensor):
        raise TypeError(
            f"loss_mask must be a torch.Tensor (T,) or None, got {type(loss_mask).__name__}"
        )
    if loss_mask is None:
        return real
    if loss_mask.shape != doc_ids_T.shape:
        raise ValueError(
            f"loss_mask must be (T,) = {tuple(doc_ids_T.shape)} like doc_ids, got "
            f"{tuple(loss_mask.shape)}; pass the stream's own mask (LeRobot's action_is_pad is "
            "served as batch['action_loss_mask'], one entry per action token), and expand a "
            "per-step mask of a grid stream with .repeat_interleave(tokens_per_step)"
        )
    return real * _to(loss_mask.to(dtype), doc_ids_T.device)


def _bucket_mass(
    doc_ids_T: torch.Tensor, m: torch.Tensor, reduction: str, tps: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(bucket of each token, mass of each bucket): an episode, or one step of an episode.

    A bucket is named by the index of its first token, found without a sync: a document
    starts at `doc_starts` (where the doc id changes), and a step starts every ``tps`` tokens
    from there.
    """
    T = doc_ids_T.shape[0]
    idx = torch.arange(T, device=doc_ids_T.device)
    start = doc_starts(doc_ids_T)
    bucket = start if reduction == "episode" else idx - (idx - start) % tps
    mass = torch.zeros(T, dtype=m.dtype, device=m.device).index_add_(0, bucket, m)
    return bucket, mass


def token_weights(
    layout: LayoutLike,
    reduction: Reduction,
    loss_mask: torch.Tensor | None = None,
    tokens_per_step: int | None = None,
    *,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Per-token weights ``w`` (T,) so that ``sum(w * loss) / D`` is the chosen mean.

    ``layout`` is a ``StreamLayout`` or the ``(T,)`` doc ids (-1 on padding). Lengths
    ``[2, 4, 3]`` padded to 10, no mask::

        doc_ids    0   0   1   1   1   1   2   2   2  -1
        token      1   1   1   1   1   1   1   1   1   0      D = 9
        episode   1/2 1/2 1/4 1/4 1/4 1/4 1/3 1/3 1/3  0      D = 3

    ``"frame"`` averages each run of ``tokens_per_step`` tokens (from the layout, or given),
    so with 2 tokens per step, lengths ``[2, 4]``: ``1/2`` everywhere, ``D = 3`` steps.
    Sync-free (index_add over token buckets), so it can run inside the compiled step.
    """
    red = _reduction(reduction)
    ids = _doc_ids(layout)
    tps = _tokens_per_step(layout, red, tokens_per_step)
    m = _mask(ids, loss_mask, dtype)
    if red == "token" or (red == "frame" and tps == 1):
        return m
    bucket, mass = _bucket_mass(ids, m, red, tps)
    per_token = mass[bucket]
    return torch.where(per_token > 0, m / torch.where(per_token > 0, per_token, 1), 0)


def _one_denominator(
    layout: LayoutLike,
    red: str,
    loss_mask: torch.Tensor | None,
    tokens_per_step: int | None,
    device: torch.device,
) -> torch.Tensor:
    tps = _tokens_per_step(layout, red, tokens_per_step)
    if isinstance(layout, StreamLayout) and loss_mask is None:
        # Python ints: known on the host, nothing to read back from the device.
        lengths = layout.lengths_K
        if red == "token":
            n = sum(lengths)
        elif red == "episode":
            n = sum(1 for x in lengths if x > 0)
        else:
            n = sum(ceil_div(x, tps) for x in lengths)
        return torch.full((), float(n), dtype=torch.float64, device=device)
    ids = _doc_ids(layout)
    m = _mask(ids, loss_mask, torch.float64)
    if red == "token" or (red == "frame" and tps == 1):
        return _to(m.sum(), device)
    _, mass = _bucket_mass(ids, m, red, tps)
    return _to((mass > 0).sum().to(torch.float64), device)


def local_denominator(
    layouts: LayoutLike | Sequence[LayoutLike],
    reduction: Reduction,
    loss_masks: torch.Tensor | Sequence[torch.Tensor | None] | None = None,
    tokens_per_step: int | None = None,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """This rank's share of ``D``: summed over the micro-batches of one optimizer step.

    ``layouts`` is one layout (or doc ids) or a sequence of them, one per micro-batch, with a
    matching ``loss_masks`` (or None). Returns a 0-d float64 tensor on ``device`` (default:
    where the first layout lives). All-padding packs add 0.
    """
    if isinstance(layouts, StreamLayout | torch.Tensor):
        items: list[LayoutLike] = [layouts]
    else:
        items = check_sequence("layouts", layouts)
        if not items:
            raise ValueError(
                "layouts=[] holds no micro-batch: the denominator would be 0 and the loss "
                "un-normalised; pass the layout of every micro-batch of the optimizer step"
            )
    if loss_masks is None or isinstance(loss_masks, torch.Tensor):
        masks: list[torch.Tensor | None] = [loss_masks] * len(items)
    else:
        masks = list(loss_masks)
    if len(masks) != len(items):
        raise ValueError(f"{len(items)} layouts but {len(masks)} loss masks; pass one per pack")
    red = _reduction(reduction)
    if device is None:
        device = _doc_ids(items[0]).device if items else torch.device("cpu")
    dev = torch.device(device)
    total = torch.zeros((), dtype=torch.float64, device=dev)
    for lay, mask in zip(items, masks, strict=True):
        total = total + _one_denominator(lay, red, mask, tokens_per_step, dev)
    return total


def global_denominator(
    layouts: LayoutLike | Sequence[LayoutLike],
    reduction: Reduction,
    loss_masks: torch.Tensor | Sequence[torch.Tensor | None] | None = None,
    tokens_per_step: int | None = None,
    *,
    group: torch.distributed.ProcessGroup | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``D`` for the whole optimizer step: this rank's micro-batches, summed over all ranks.

    One ``all_reduce(SUM)`` of a 0-d float64 tensor over ``group`` (the default group) when
    ``torch.distributed`` is initialised; the local value otherwise. Put it on the device
    your backend reduces on (CUDA for NCCL): asynchronous, no host sync.
    """
    d = local_denominator(layouts, reduction, loss_masks, tokens_per_step, device=device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(d, op=torch.distributed.ReduceOp.SUM, group=group)
    return d


def reduce_loss(
    loss: torch.Tensor,
    layout: LayoutLike,
    reduction: Reduction,
    loss_mask: torch.Tensor | None = None,
    tokens_per_step: int | None = None,
    *,
    denominator: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """``sum(w * loss) / denominator`` for one pack; ``loss`` is ``(T,)`` or ``(T, ...)``.

    With ``denominator=None`` the pack's own ``D`` is used: exact only when this pack is the
    whole optimizer step on a single rank. Otherwise pass ``global_denominator(...)`` (or use
    ``LossNormalizer``). Padding and masked tokens contribute exactly 0 even if their loss is
    inf or NaN (it is selected away, not multiplied by 0); their gradient is exactly 0 too,
    unless the model's own derivative on those rows is NaN (0 * NaN in the chain rule), so
    keep padding rows finite. A step with nothing to learn (D = 0) gives 0, not NaN.

    A ``denominator`` given as a number must be > 0 (0 or below would return the plain
    sum); a host tensor D <= 0 with loss to normalise is refused, a device tensor one (not read:
    no sync) gives NaN. Host doc ids must be contiguous runs in increasing order, as
    `make_block_mask` requires (``[0, 0, 1, 1, 0, 0]`` would count three episodes).
    """
    ids = _doc_ids(layout)
    if not isinstance(loss, torch.Tensor) or loss.dim() == 0:
        raise ValueError(
            f"loss must be the per-token loss, a tensor (T,) or (T, ...), got "
            f"{_describe(loss)}; compute it with reduction='none' (a mean over the pack "
            "cannot be re-weighted per episode)"
        )
    if not (loss.dtype.is_floating_point or loss.dtype.is_complex):
        raise TypeError(f"loss must be a floating-point tensor, got {loss.dtype}")
    if loss.device != ids.device:
        raise ValueError(
            f"loss is on {loss.device} but the doc ids on {ids.device}; compute the loss from "
            "the batch on its device (batch.to(device) moves the layouts with it)"
        )
    if loss.shape[0] != ids.shape[0]:
        raise ValueError(
            f"loss has {loss.shape[0]} rows but the layout has {ids.shape[0]} tokens; a step-"
            "level loss of a grid stream needs step-level doc ids (conditioning.step_doc_ids)"
        )
    loss_T = loss.float() if loss.dtype in (torch.float16, torch.bfloat16) else loss
    if loss_T.dim() > 1:
        loss_T = loss_T.flatten(1).mean(dim=1)
    w = token_weights(layout, reduction, loss_mask, tokens_per_step, dtype=loss_T.dtype)
    total = (torch.where(w != 0, loss_T, 0) * w).sum()
    if denominator is None:
        denominator = local_denominator(layout, reduction, loss_mask, tokens_per_step)
    elif not isinstance(denominator, torch.Tensor):
        # A number given by hand: 0 or below would return the un-normalised sum.
        value = check_real(
            "denominator", denominator, above=0, hint="pass global_denominator(...) or None"
        )
        denominator = torch.tensor(value, dtype=torch.float64)
    elif denominator.numel() != 1:
        raise ValueError(
            f"denominator must be a number or a 0-d tensor, got shape "
            f"{tuple(denominator.shape)}; pass global_denominator(...)"
        )
    elif (
        denominator.device.type == total.device.type == "cpu"
        and not bool(denominator.reshape(()) > 0)
        and bool(total != 0)  # D = 0 with nothing to learn is an all-padding step: 0
    ):
        raise ValueError(
            f"denominator={denominator.item()} must be > 0 when the pack has loss to "
            "normalise; pass global_denominator(...) of this optimizer step"
        )
    d = _to(denominator.reshape(()).to(total.dtype), total.device)
    # D <= 0 with loss to normalise (a device tensor, unread): NaN, loud, not the plain sum.
    nothing = torch.where(total == 0, 0.0, float("nan")).to(total.dtype)
    return torch.where(d > 0, total / torch.where(d > 0, d, 1), nothing)


@dataclass(frozen=True, kw_only=True)
class LossNormalizer:
    """The normaliser of one optimizer step; build it with ``for_step`` before any backward.

    ::

        micro = [next(loader) for _ in range(accum)]          # all micro-batches first
        norm = LossNormalizer.for_step([b.layout("action") for b in micro], "episode",
                                       [b["action_loss_mask"] for b in micro], device="cuda")
        for b in micro:
            norm(loss_T(b), b.layout("action"), b["action_loss_mask"]).backward()

    No division by ``accum`` and no extra DP factor in user code: ``denominator`` already
    covers every micro-step and rank, and ``grad_scale`` (W under DDP/FSDP, which average
    gradients over W ranks; 1 otherwise) undoes that averaging. For logging, the sum over
    micro-steps of ``loss.detach() / norm.grad_scale``, all-reduced over ranks, is the step's
    loss.
    """

    reduction: Reduction
    denominator: torch.Tensor
    grad_scale: float = 1.0
    tokens_per_step: int | None = None

    def __post_init__(self) -> None:
        _reduction(self.reduction)
        check_real("grad_scale", self.grad_scale, above=0, hint="the DP world size, or 1")
        check_optional_int("tokens_per_step", self.tokens_per_step, min=1)
        if not isinstance(self.denominator, torch.Tensor) or self.denominator.numel() != 1:
            raise TypeError(
                f"denominator must be a 0-d tensor, got {_describe(self.denominator)}; build "
                "the normaliser with LossNormalizer.for_step(layouts, reduction)"
            )

    @classmethod
    def for_step(
        cls,
        layouts: Sequence[LayoutLike],
        reduction: Reduction,
        loss_masks: Sequence[torch.Tensor | None] | None = None,
        *,
        tokens_per_step: int | None = None,
        group: torch.distributed.ProcessGroup | None = None,
        dp_averages_gradients: bool = True,
        device: torch.device | str | None = None,
    ) -> LossNormalizer:
        """All micro-batches of this rank for one optimizer step -> the step's normaliser.

        One all_reduce when ``torch.distributed`` is initialised. Set
        ``dp_averages_gradients=False`` if your gradients are *summed* over ranks.
        """
        check_bool("dp_averages_gradients", dp_averages_gradients)
        one = isinstance(layouts, StreamLayout | torch.Tensor)
        items: list[LayoutLike] = [layouts] if one else check_sequence("layouts", layouts)  # type: ignore[list-item]
        if not items:
            raise ValueError(
                "LossNormalizer.for_step([]): no micro-batch, so no denominator; pass the "
                "layouts of every micro-batch of this optimizer step (fetch them first)"
            )
        d = global_denominator(
            items, reduction, loss_masks, tokens_per_step, group=group, device=device
        )
        world = 1
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            world = torch.distributed.get_world_size(group)
        scale = float(world) if dp_averages_gradients else 1.0
        return cls(
            reduction=reduction, denominator=d, grad_scale=scale, tokens_per_step=tokens_per_step
        )

    def __call__(
        self,
        loss: torch.Tensor,
        layout: LayoutLike,
        loss_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This micro-batch's loss to ``backward()``: ``grad_scale * sum(w * loss) / D``."""
        out = reduce_loss(
            loss,
            layout,
            self.reduction,
            loss_mask,
            self.tokens_per_step,
            denominator=self.denominator,
        )
        return out * self.grad_scale if self.grad_scale != 1.0 else out


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r}"
