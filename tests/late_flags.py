"""A device far behind the host, on the CPU: each model call's non-finite flags come with an
event that completes only when the host waits for it, so a test sees every wait the engine
makes (`tests/test_serve_pacing.py`) and every result it must still hand out
(`tests/test_serve_faults.py`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from packing.serve import Engine


class LateEvent:
    """A CUDA event stand-in whose copy has not arrived until someone waits for it."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def flags_arrive_late(monkeypatch: pytest.MonkeyPatch) -> list[LateEvent]:
    """Patch every engine so each model call's flags come with a `LateEvent`; returns them in
    call order."""
    events: list[LateEvent] = []

    def copy(self: Any, flags: torch.Tensor) -> tuple[torch.Tensor, LateEvent]:
        events.append(LateEvent())
        return flags.clone(), events[-1]

    monkeypatch.setattr(Engine, "_copy_flags", copy)
    return events
