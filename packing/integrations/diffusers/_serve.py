"""A packed diffusers Wan as a `packing.serve.VideoModel`, and the one-request reference.

`ServedWan` is the engine's side of the protocol: one velocity over the whole pack from the
pack's doc ids, with per-token times (a context frame's tokens at ``t = 0``, Wan 2.2 TI2V's
clean first frame). The masks are built inside the call from doc ids alone
(`packing.serve.protocol.masks_from_doc_ids`), so a captured step stays right for any composition::

    engine      t_T in [0, 1] per token, x (S, C, H, W), text rows (X, D_txt), doc ids
    ServedWan   1000 * t_T -> PackedWan.packed_forward (the training forward, per-token adaLN)
                self mask: doc_T == doc_T'   cross mask: doc_T == text_doc_X

`reference_generate` is what it is proved against: the UNMODIFIED ``WanTransformer3DModel``
called on one request alone (``(1, C, F, H, W)``, its own ``(1, seq_len)`` timestep as the
TI2V pipeline's ``expand_timesteps`` builds it, or ``(1,)`` with no context), with the same
noise and the same scheduler update.
"""

from __future__ import annotations

from typing import Any

import torch
from einops import rearrange
from torch import Tensor, nn

from packing._validate import check_int_tuple
from packing.attention import resolve_backend
from packing.integrations.diffusers._adapter import TIMESTEP_SCALE
from packing.integrations.diffusers._wan import PackedWan
from packing.serve import FlowScheduler, VideoPack, VideoRequest
from packing.serve.protocol import masks_from_doc_ids

__all__ = ["ServedWan", "reference_generate"]


class ServedWan:
    """``ServedWan(packed, latent_hw=(H, W))``: a `PackedWan` served by
    `packing.serve.VideoEngine`. The adapter's ``attention`` (``auto``: sdpa on CPU, Flex on
    CUDA; varlen is refused: it needs host-side lengths) and ``document_mask`` are used."""

    def __init__(self, packed: PackedWan, *, latent_hw: tuple[int, int] | None = None) -> None:
        if not isinstance(packed, PackedWan):
            raise TypeError(
                f"ServedWan takes a PackedWan (install(WanTransformer3DModel)), got "
                f"{type(packed).__name__}"
            )
        if not packed.installed:
            raise ValueError("this PackedWan was uninstalled; install(model) again to serve it")
        given = latent_hw if latent_hw is not None else packed.latent_hw
        if given is None:
            raise ValueError("pass latent_hw=(H, W), the latent frame size to serve")
        hw = check_int_tuple("latent_hw", given, length=2)
        ph, pw = packed.patch_hw
        if hw[0] % ph or hw[1] % pw:
            raise ValueError(f"latent_hw={tuple(hw)} is not divisible by the patch {ph}x{pw}")
        p = next(packed.transformer.parameters())
        self.packed, self.device = packed, p.device
        self.frame_shape = (packed.in_channels, int(hw[0]), int(hw[1]))
        self.grid = (int(hw[0]) // ph, int(hw[1]) // pw)
        self.text_dim = packed.text_dim
        head_dim = int(packed.transformer.config.attention_head_dim)
        self.backend = resolve_backend(
            packed.attention_backend, device=p.device, dtype=p.dtype, head_dim=head_dim
        )
        if self.backend == "varlen":
            raise ValueError(
                "the engine builds its masks inside the step from doc ids; backend 'varlen' "
                "needs host-side lengths: install with attention='flex' (or 'sdpa' on CPU)"
            )

    def velocity(self, x_SCHW: Tensor, t_T: Tensor, text_XD: Tensor, pack: VideoPack) -> Tensor:
        """The packed Wan's velocity ``(S, C, H, W)``; ``t_T`` per token in [0, 1]."""
        p, dtype = self.packed, self.packed.transformer.dtype
        if not p.installed:  # its packed blocks need the swapped processors
            raise ValueError("this PackedWan was uninstalled; install(model) again to serve it")
        self_mask, cross_mask = masks_from_doc_ids(
            pack.doc_T, pack.text_doc_X, backend=self.backend, inner=None,
            document_mask=p.document_mask,
        )  # fmt: skip
        prep = {"self_mask": self_mask, "cross_mask": cross_mask, "rope": p.rope_rows(pack.thw_T3)}
        return p.packed_forward(  # type: ignore[no-any-return]
            x_SCHW.to(dtype),
            prep,
            pack.doc_T,
            TIMESTEP_SCALE * t_T,
            text_XD.to(dtype),
            per_token=True,
        )


def reference_generate(
    model: nn.Module, request: VideoRequest, scheduler: FlowScheduler | None = None
) -> Tensor:
    """``request`` denoised alone by the unmodified ``WanTransformer3DModel`` ``model``:
    the generated frames ``(frames, C, H, W)``, fp32, with the engine's noise and update
    (``x += a_i v_i + b_i v_{i-1}`` on the generated frames, context left clean)."""
    scheduler = scheduler if scheduler is not None else FlowScheduler()
    dev = next(model.parameters()).device
    dtype: Any = next(model.parameters()).dtype
    f_c, n = request.context.shape[0], request.steps
    config: Any = model.config  # typed by diffusers, not here
    ph, pw = (int(s) for s in config.patch_size[1:])
    _, h, w = request.context.shape[1:]
    tpf = (h // ph) * (w // pw)
    x = torch.cat([request.context.float().cpu(), request.noise()]).to(dev)
    text = request.text.to(dev, dtype)[None]
    sig = torch.tensor(scheduler.sigmas(n)[:n]).float()
    coef = torch.tensor(scheduler.coefficients(n)).float()
    vp = torch.zeros_like(x[f_c:])
    for i in range(n):
        t = TIMESTEP_SCALE * sig[i].to(dev)
        if f_c:  # the TI2V pipeline's expand_timesteps: 0 on the context frames' tokens
            timestep = torch.cat([t.new_zeros(f_c * tpf), t.expand(request.frames * tpf)])[None]
        else:
            timestep = t[None]
        video = rearrange(x.to(dtype), "f c h w -> 1 c f h w")
        with torch.no_grad():
            out = model(video, timestep, text, return_dict=False)[0]
        v = rearrange(out, "1 c f h w -> f c h w")[f_c:].float()
        a, b = coef[i].to(dev)
        x[f_c:] = x[f_c:] + a * v + b * vp
        vp = v
    return x[f_c:]
