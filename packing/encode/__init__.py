"""The first mile: a LeRobot v3 dataset with camera videos -> a latent dataset packing trains on.

- `encode_dataset` (``packing encode SRC DST --vae ...``): decode each episode's cameras with
  lerobot's own decoder, resize/crop, encode with a diffusers ``AutoencoderKLWan`` in causal
  chunks (== the whole-episode encode), write a LeRobot v3 dataset: one ``{camera}.latent``
  feature per camera, every non-video feature and the episode/task tables carried over, one
  row per video frame; ``LeRobotEpisodes`` serves each episode's ``1 + (F-1)/4`` latents.
- `EncodeConfig` / `EncodeReport`: the job, and what it did. `EncodeError`: bad input.
- `tiny_vae`: a random-init Wan-2.2-shaped VAE small enough for tests on a CPU.

Needs the ``encode`` extra (lerobot, diffusers; README: Install), imported on first use.
"""

from packing.encode._config import EncodeConfig, EncodeReport
from packing.encode._encode import encode_dataset
from packing.encode._errors import EncodeError
from packing.encode._vae import tiny_vae

__all__ = ["EncodeConfig", "EncodeError", "EncodeReport", "encode_dataset", "tiny_vae"]
