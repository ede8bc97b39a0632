"""Regenerate the embedded default dataset in packing/datasets/_embedded with lerobot's writer.

    HF_HUB_OFFLINE=1 python scripts/make_default_dataset.py

Needs the ``lerobot`` extra (README: Install). Writes to a temporary directory first, checks the
result reads back exactly through lerobot's own reader, then replaces packing/datasets/_embedded.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np

from packing.datasets import LeRobotEpisodes
from packing.datasets._default import DEFAULT_LENGTHS, write_default_dataset

DEST = Path(__file__).resolve().parents[1] / "packing" / "data" / "default"


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = write_default_dataset(Path(tmp) / "default")
        eps = LeRobotEpisodes(root, keys=["latents", "action"])
        assert eps.lengths.tolist() == list(DEFAULT_LENGTHS), eps.lengths
        assert np.isfinite(eps[0]["latents"].float().numpy()).all()
        # lerobot writes nothing outside these; drop anything else (caches, locks).
        keep = {"data", "meta"}
        for p in root.iterdir():
            if p.name not in keep:
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        if DEST.exists():
            shutil.rmtree(DEST)
        shutil.copytree(root, DEST)
    size = sum(p.stat().st_size for p in DEST.rglob("*") if p.is_file())
    print(f"wrote {DEST} ({size / 1e6:.2f} MB, {len(DEFAULT_LENGTHS)} episodes)")


if __name__ == "__main__":
    main()
