"""The video VAE: diffusers' ``AutoencoderKLWan``, run chunk by chunk through its own cache.

diffusers encodes a whole clip in one call: the first frame alone, then groups of 4, each
group one call of the causal encoder that reads and updates a feature cache (the last frames
every causal conv needs). `CausalEncoder` makes the same calls on the same cache, but lets
the frames arrive in chunks, so an episode of any length is encoded in bounded memory and
the result is the whole-clip encode (tested: chunked == ``vae.encode(whole)``)::

    frames    0 | 1 2 3 4 | 5 6 7 8 | 9 ...        chunk 1: frames 0-4, chunk 2: 5-12, ...
    calls     e | e       | e       | e            e = encoder(group, feat_cache)
    latents   0 | 1       | 2       | 3

Latents are the posterior mean (``latent_dist.mode()``), normalised per channel with the
VAE config's ``latents_mean``/``latents_std`` as diffusers' Wan pipelines do.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from packing._lazy import require
from packing._validate import check_int
from packing.encode._errors import EncodeError

__all__ = [
    "WAN22_VAE_CONFIG",
    "CausalEncoder",
    "check_compression",
    "load_vae",
    "tiny_vae",
    "vae_name",
]

# Wan 2.2's VAE (Wan-AI/Wan2.2-TI2V-5B-Diffusers, vae/config.json): 48 latent channels, 16x
# space (8x convs on 2x2-patchified pixels), 4x time. Random-init at this size for benchmarks.
WAN22_VAE_CONFIG: dict[str, Any] = {
    "base_dim": 160,
    "decoder_base_dim": 256,
    "z_dim": 48,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 2,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "dropout": 0.0,
    "is_residual": True,
    "in_channels": 12,
    "out_channels": 12,
    "patch_size": 2,
    "scale_factor_temporal": 4,
    "scale_factor_spatial": 16,
    "latents_mean": [0.0] * 48,
    "latents_std": [1.0] * 48,
}


def tiny_vae(seed: int = 0) -> Any:
    """A random-init ``AutoencoderKLWan`` of Wan 2.2's design (residual, 2x2 patches, 16x
    space, 4x time) with 8 latent channels and ~0.3 M parameters: fast on a CPU, for tests
    and examples. ``tiny_vae()`` encodes ``(1, 3, 9, 32, 48)`` pixels to ``(1, 8, 3, 2, 3)``."""
    check_int("seed", seed, min=0, max=2**63 - 1)
    diffusers = require("diffusers", extra="encode")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = diffusers.AutoencoderKLWan(
            **{
                **WAN22_VAE_CONFIG,
                "base_dim": 8,
                "decoder_base_dim": 8,
                "z_dim": 8,
                "num_res_blocks": 1,
                "latents_mean": [0.0] * 8,
                "latents_std": [1.0] * 8,
            }
        )
    return vae.eval()


def load_vae(spec: str, *, seed: int = 0) -> Any:
    """``"tiny"`` (`tiny_vae`), ``"wan2.2-config"`` (Wan 2.2's size, random init, for
    benchmarks) or a local diffusers folder (``vae/`` of a Wan checkpoint, or its parent).
    Nothing is downloaded: a path that is not a folder is refused."""
    diffusers = require("diffusers", extra="encode")
    if spec == "tiny":
        return tiny_vae(seed)
    if spec == "wan2.2-config":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return diffusers.AutoencoderKLWan(**WAN22_VAE_CONFIG).eval()
    path = Path(spec).expanduser()
    if (path / "vae" / "config.json").is_file():
        path = path / "vae"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"--vae {spec}: no diffusers VAE folder there (expected {path / 'config.json'}); "
            "give a local folder holding AutoencoderKLWan's config.json and weights (e.g. "
            "the vae/ folder of Wan2.2-TI2V-5B-Diffusers), or 'tiny' for the test VAE"
        )
    kind = _class_name(path / "config.json")
    if kind != "AutoencoderKLWan":
        raise EncodeError(
            f"--vae {spec}: {path / 'config.json'} describes a {kind}, not a VAE; give the "
            "folder holding AutoencoderKLWan's config.json (the vae/ folder of a Wan checkpoint)"
        )
    try:
        return diffusers.AutoencoderKLWan.from_pretrained(os.fspath(path)).eval()
    except (OSError, ValueError, RuntimeError, TypeError, KeyError) as e:
        first = " ".join(str(e).split())[:300]
        raise EncodeError(
            f"--vae {spec}: diffusers cannot load {path} as an AutoencoderKLWan "
            f"({type(e).__name__}: {first}); check that its weights are whole and match its "
            "config.json"
        ) from e


def _class_name(config_json: Path) -> str:
    """The ``_class_name`` diffusers wrote into a model folder's config.json."""
    try:
        config = json.loads(config_json.read_text())
    except (OSError, ValueError) as e:
        raise EncodeError(f"--vae: cannot read {config_json} as JSON ({e})") from e
    name = config.get("_class_name") if isinstance(config, dict) else None
    return name if isinstance(name, str) else "model of no _class_name"


def check_compression(
    spec: str, encoder: CausalEncoder, device: torch.device, dtype: torch.dtype
) -> None:
    """The VAE compresses as its config says (``scale_factor_temporal``/``_spatial``, which
    plan the latent rows and sizes): a probe of ``1 + 2*tc`` frames of ``2s x 2s`` black
    pixels must give 3 latent frames of 2x2 and ``z_dim`` channels. A config that misstates
    it would otherwise write a dataset nobody can read correctly."""
    vae, tc = encoder.vae, encoder.tc
    s = int(vae.config.scale_factor_spatial or 8)
    frames = 1 + 2 * tc
    probe = torch.zeros(1, 3, frames, 2 * s, 2 * s, device=device, dtype=dtype)
    encoder.reset()
    try:
        got = tuple(encoder.push(probe).shape[1:])
    except (RuntimeError, ValueError) as e:
        got, why = (), f"it fails on them ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
    finally:
        encoder.reset()
    want = (encoder.z, 3, 2, 2)
    if got == want:
        return
    if got:
        c, m, h, w = got
        t_real = f"{(frames - 1) / (m - 1):g}x" if m > 1 else "?x"
        why = (f"it gives {m} latent frames of {h}x{w} with {c} channels ({t_real} time, "
               f"{2 * s / max(h, 1):g}x space)")  # fmt: skip
    raise EncodeError(
        f"--vae {spec}: its config says {tc}x time, {s}x space and {encoder.z} channels "
        f"(scale_factor_temporal, scale_factor_spatial, z_dim), so {frames} frames of "
        f"{2 * s}x{2 * s} pixels should give 3 latent frames of 2x2, but {why}; fix its "
        "config.json"
    )


def vae_name(spec: str, vae: Any) -> str:
    """How the dataset's metadata names the VAE: the spec and its latent channels."""
    return f"{spec} (AutoencoderKLWan, z_dim {vae.config.z_dim})"


class CausalEncoder:
    """Encodes a batch of clips whose frames arrive in chunks, exactly as one whole call.

    ``push(frames)`` takes ``(B, 3, T, H, W)`` pixels in [-1, 1]; the first push must hold
    ``1 + 4m`` frames, later ones ``4m`` (whole latent groups); it returns the ``(B, C, m', h,
    w)`` latents of those frames. The cache lives between pushes; `reset` starts new clips.
    """

    def __init__(self, vae: Any) -> None:
        self.vae = vae
        self.tc = int(vae.config.scale_factor_temporal or 4)
        self.z = int(vae.config.z_dim)
        mean = torch.tensor(vae.config.latents_mean, dtype=torch.float32)
        std = torch.tensor(vae.config.latents_std, dtype=torch.float32)
        if mean.numel() != self.z or std.numel() != self.z:
            raise ValueError(
                f"the VAE's config has {mean.numel()} latents_mean / {std.numel()} latents_std "
                f"values for z_dim={self.z} channels; fix its config.json"
            )
        self.mean, self.std = mean.view(1, -1, 1, 1, 1), std.view(1, -1, 1, 1, 1)
        self.reset()

    def reset(self) -> None:
        self.vae.clear_cache()
        self.started = False

    @torch.no_grad()
    def push(self, frames: torch.Tensor) -> torch.Tensor:
        vae, tc = self.vae, self.tc
        n = frames.shape[2]
        first = 0 if self.started else 1
        if (n - first) % tc or n < first:
            raise ValueError(
                f"a chunk of {n} frames: the first chunk of a clip holds 1 + {tc}m frames, "
                f"later ones {tc}m (whole latent groups)"
            )
        x = frames
        if vae.config.patch_size is not None:
            x = require(
                "diffusers.models.autoencoders.autoencoder_kl_wan", extra="encode"
            ).patchify(x, patch_size=vae.config.patch_size)
        # The groups diffusers' AutoencoderKLWan._encode makes: frame 0 alone, then tc each.
        bounds = ([(0, 1)] if first else []) + [(s, s + tc) for s in range(first, n, tc)]
        outs = []
        for lo, hi in bounds:
            vae._enc_conv_idx = [0]
            outs.append(
                vae.encoder(
                    x[:, :, lo:hi], feat_cache=vae._enc_feat_map, feat_idx=vae._enc_conv_idx
                )
            )
        self.started = True
        h = vae.quant_conv(torch.cat(outs, 2))  # a 1x1x1 conv: per frame, chunk-safe
        mu = h[:, : self.z].float()  # the posterior's mean (DiagonalGaussianDistribution.mode)
        return (mu - self.mean.to(mu.device)) / self.std.to(mu.device)
