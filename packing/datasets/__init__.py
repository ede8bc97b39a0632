"""Whole episodes from where robot data lives.

- `LeRobotEpisodes`: a LeRobot v3 dataset root (read with pyarrow alone) or a
  ``LeRobotDataset`` instance; `episode_lengths` reads only the metadata.
- `HFEpisodes`: a Hugging Face ``datasets.Dataset`` of frames (the ``hf`` extra, README: Install).
- `default_dataset_root`: the small LeRobot dataset shipped in the wheel (`packing verify`'s
  default); `write_default_dataset` writes it again, from its seed.
"""

from packing.datasets._default import default_dataset_root, write_default_dataset
from packing.datasets._hf import HFEpisodes
from packing.datasets._lerobot import LeRobotEpisodes, episode_lengths

__all__ = [
    "HFEpisodes",
    "LeRobotEpisodes",
    "default_dataset_root",
    "episode_lengths",
    "write_default_dataset",
]
