"""Test-wide settings.

Hypothesis runs derandomized: the same examples on every run, so CI never flakes on an
unlucky draw (the guards that "the interesting case occurred" count over a fixed sample).
Set HYPOTHESIS_PROFILE=explore to draw fresh examples locally.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("explore", deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
