"""The embedded default dataset: a small LeRobot v3 latent dataset shipped inside the package.

``packing verify`` and the examples run on it, through the same :class:`LeRobotEpisodes` path
a user's dataset takes. It was written by lerobot's own writer (:func:`write_default_dataset`,
regenerate with ``python scripts/make_default_dataset.py``)::

    12 episodes, lengths  5 2 9 3 7 4 8 2 6 9 3 5   (63 frames, one latent frame per row)
    latents  float16 (48, 8, 16)   pre-encoded video latents, one per latent frame
    action   float32 (14,)         one action per latent frame
    task     3 task texts, episode e has task e % 3
    fps      10 (the latent rate)

Values are seeded normals (latents) and smooth per-episode trajectories (actions): nothing
to learn, everything to compare.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from packing._lazy import require
from packing._validate import check_int, check_path, check_sequence

__all__ = [
    "DEFAULT_LENGTHS",
    "DEFAULT_TASKS",
    "default_dataset_root",
    "write_default_dataset",
]

DEFAULT_LENGTHS = (5, 2, 9, 3, 7, 4, 8, 2, 6, 9, 3, 5)
DEFAULT_TASKS = ("pick up the red cube", "open the top drawer", "stack the blue block on the cup")
DEFAULT_FEATURES = {
    "latents": {"dtype": "float16", "shape": (48, 8, 16), "names": None},
    "action": {"dtype": "float32", "shape": (14,), "names": None},
}
DEFAULT_FPS = 10


def default_dataset_root() -> Path:
    """The root of the shipped dataset (``packing/datasets/_embedded``), checked to be present."""
    root = Path(__file__).resolve().parent / "_embedded"
    if not (root / "meta" / "info.json").is_file():
        raise FileNotFoundError(
            f"the embedded default dataset is missing at {root} (expected meta/info.json): "
            "the package data was not installed; reinstall packing, or regenerate it with "
            "python scripts/make_default_dataset.py (needs the lerobot extra: "
            "pip install -e '.[lerobot]' -c constraints.txt)"
        )
    return root


def write_default_dataset(
    root: str | os.PathLike[str],
    *,
    lengths: tuple[int, ...] = DEFAULT_LENGTHS,
    seed: int = 0,
) -> Path:
    """Write the default dataset to ``root`` (must not exist) with lerobot's writer.

    Deterministic: the same ``lengths`` and ``seed`` give the same frames. Episodes of one frame
    are refused because lerobot 0.6.1's writer fails to aggregate their stats.
    """
    lengths = tuple(
        check_int(f"lengths[{i}]", n) for i, n in enumerate(check_sequence("lengths", lengths))
    )
    check_int("seed", seed, min=0, max=2**32 - 1, hint="numpy's default_rng seed")
    if not lengths or min(lengths) < 2:
        raise ValueError(
            f"lengths {lengths} contain an episode shorter than 2 frames; lerobot 0.6.1's writer "
            "cannot aggregate stats of a one-frame episode with a multi-dimensional feature"
        )
    root = Path(check_path("root", root)).expanduser()
    if root.exists():
        raise FileExistsError(
            f"root={os.fspath(root)!r} exists; write_default_dataset writes a new dataset "
            "there: pass a path that does not exist yet"
        )
    lerobot_dataset = require("lerobot.datasets.lerobot_dataset", extra="lerobot")  # args first
    ds = lerobot_dataset.LeRobotDataset.create(
        repo_id="packing/default",
        fps=DEFAULT_FPS,
        features=DEFAULT_FEATURES,
        root=root,
        use_videos=False,
    )
    rng = np.random.default_rng(seed)
    for e, n in enumerate(lengths):
        latents = rng.standard_normal((n, 48, 8, 16)).astype(np.float16)
        # Smooth joint trajectories: a per-episode phase and frequency per joint.
        t = np.arange(n, dtype=np.float32)[:, None] / DEFAULT_FPS
        phase, freq = rng.uniform(0, 2 * np.pi, 14), rng.uniform(0.5, 2.0, 14)
        action = np.sin(2 * np.pi * freq * t + phase).astype(np.float32)
        for f in range(n):
            ds.add_frame(
                {
                    "latents": latents[f],
                    "action": action[f],
                    "task": DEFAULT_TASKS[e % len(DEFAULT_TASKS)],
                }
            )
        ds.save_episode()
    ds.finalize()
    return root
