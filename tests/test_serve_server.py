"""The policy-server example: 3 environment processes, one engine, answers equal to each
request served alone."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from packing.serve import Request

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import policy_server


@pytest.mark.usefixtures("one_thread")
def test_three_environments_against_one_engine():
    demo = policy_server.run_demo(clients=3, rounds=2)
    assert demo["answered"] == 6
    seen = sorted((c, r) for c, r, *_ in demo["exchanges"])
    assert seen == [(c, r) for c in range(3) for r in range(2)]
    # every reply is what the request gives alone (the engine's proof, end to end)
    alone = policy_server.build_engine()
    for _, _, context, fields, latents, action in demo["exchanges"]:
        alone.submit(Request(context=torch.from_numpy(context.copy()), **fields))
        (ref,) = alone.run()
        np.testing.assert_allclose(latents, ref.latents.numpy(), rtol=0, atol=1e-5)
        np.testing.assert_allclose(action, ref.action.numpy(), rtol=0, atol=1e-5)
    assert sum(demo["steps_with"]) == 6 * policy_server.FIELDS["steps"]
