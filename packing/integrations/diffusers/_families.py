"""Which adapter packs which diffusers model: `install` picks it by the model's class.

    WanTransformer3DModel        -> wan.PackedWan    (Wan 2.1 T2V, Wan 2.2 TI2V)
    LTXVideoTransformer3DModel   -> ltx.PackedLTX    (LTX-Video)

A third family is its module (a `PackedAdapter` with ``model_cls``) and one line here.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from packing.integrations.diffusers._adapter import PackedAdapter
from packing.integrations.diffusers._ltx import PackedLTX
from packing.integrations.diffusers._wan import PackedWan

__all__ = ["FAMILIES", "install"]

FAMILIES: tuple[type[PackedAdapter], ...] = (PackedWan, PackedLTX)


def install(transformer: nn.Module, **options: Any) -> PackedAdapter:
    """Pack a loaded diffusers video transformer: ``packed = install(model, latent_hw=(H, W))``.

    Options are the family's (`PackedWan`, `PackedLTX`). Adds and renames no parameter
    (``model.state_dict()`` is as before); ``packed.uninstall()`` (or ``with install(...) as
    packed:``) undoes it.
    """
    for family in FAMILIES:
        if isinstance(transformer, family.model_cls):
            return family(transformer, **options)
    names = " or ".join(f"{f.model_cls.__module__}.{f.model_cls.__name__}" for f in FAMILIES)
    got = f"{type(transformer).__module__}.{type(transformer).__name__}"
    if type(transformer).__module__.startswith("lerobot.policies.lingbot_va"):
        raise TypeError(
            f"expected {names}, got {got}: LeRobot's LingBot-VA (a dual-stream Wan, not "
            "diffusers'); pack it with packing.integrations.lingbot_va.install(policy, "
            "latent_hw=(H, W)) (docs/lingbot-va.md)"
        )
    raise TypeError(
        f"expected {names}, got {got}; another model of the same structure needs its own "
        "adapter (docs/porting.md, 'Another diffusers video transformer')"
    )
