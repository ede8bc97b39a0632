"""The largest sizes the engines take, checked where a size enters (configs, shapes, requests,
the server's adapters), so a value no GPU could hold is refused at once, naming its field,
instead of hanging in a Python loop or failing in a later step.

They are far above any real policy call: a 10-step chunk, a pack of 16 robots, a few hundred
context frames. ``MAX_STEPS`` bounds the schedule tables ``(requests, max_steps)`` and the
solver's coefficient lists; ``MAX_REQUESTS`` the requests of one pack; ``MAX_FRAMES``,
``MAX_ACTIONS`` and ``MAX_TEXT`` the frames, action steps and text rows of a request or pack
(their tokens index int64 tensors, but a pack's buffers are allocated whole).
"""

from __future__ import annotations

__all__ = ["MAX_ACTIONS", "MAX_FRAMES", "MAX_REQUESTS", "MAX_STEPS", "MAX_TEXT"]

MAX_STEPS = 10_000
MAX_REQUESTS = 4_096
MAX_FRAMES = 1 << 20
MAX_ACTIONS = 1 << 24
MAX_TEXT = 1 << 20
