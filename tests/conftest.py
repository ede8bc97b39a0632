"""Test-wide settings.

Hypothesis runs derandomized: the same examples on every run, so CI never flakes on an
unlucky draw (the guards that "the interesting case occurred" count over a fixed sample).
Set HYPOTHESIS_PROFILE=explore to draw fresh examples locally.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import settings

# Under pytest-xdist each worker is a process of its own (CI: `-n 2` on 2 cores): torch's
# default of one intra-op thread per core would put 2 x 2 threads on 2 cores, and the tests'
# tensors are small. One thread each, as `packing verify` defaults to (docs/verify.md measured
# ~10x slower with a thread per core on a busy 2-core machine).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("explore", deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def user_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A lerobot-written dataset with non-default feature names and shapes (user_dataset.py)."""
    pytest.importorskip("lerobot.datasets.lerobot_dataset", reason="needs packing[lerobot]")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from user_dataset import write_user_dataset

    return write_user_dataset(tmp_path_factory.mktemp("user") / "my_robot")


@pytest.fixture
def one_thread():
    """One torch thread for the test (restored after): tiny models on 2 busy cores only get
    slower with more. Use as ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
