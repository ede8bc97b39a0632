"""A user's own LeRobot v3 latent dataset, written by lerobot's writer, with names and shapes
that are not packing's defaults (``observation.latent`` (16, 6, 10), ``action`` (7,), plus a
``observation.state`` (5,) that is not a model stream). Action values encode identity:
``action[t] == 100 * episode + t``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

LENGTHS = (3, 5, 2, 4, 6, 3)
LATENT = (16, 6, 10)  # 6 x 10 latents, 2x2 patches: 15 tokens a frame (not a divisor of 128)
FEATURES = {
    "observation.latent": {"dtype": "float16", "shape": LATENT, "names": None},
    "observation.state": {"dtype": "float32", "shape": (5,), "names": None},
    "action": {"dtype": "float32", "shape": (7,), "names": None},
}


def write_user_dataset(root: Path, lengths: tuple[int, ...] = LENGTHS) -> Path:
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    ds = LeRobotDataset.create(
        repo_id="user/robot", fps=5, features=FEATURES, root=root, use_videos=False
    )
    rng = np.random.default_rng(0)
    for e, n in enumerate(lengths):
        for t in range(n):
            ds.add_frame(
                {
                    "observation.latent": rng.standard_normal(LATENT).astype(np.float16),
                    "observation.state": rng.standard_normal(5).astype(np.float32),
                    "action": np.full(7, 100 * e + t, dtype=np.float32),
                    "task": ("pick", "place")[e % 2],
                }
            )
        ds.save_episode()
    ds.finalize()
    return root
