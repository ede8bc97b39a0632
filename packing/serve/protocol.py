"""Serving your own model: the protocol behind `Engine`, for model (and adapter) authors.

`Engine` is one continuous-batching loop for every served model; a model is served through a
`Packs` subclass, which owns the model's static pack shapes, their device buffers (and its
cache, if it keeps one), and says how requests are laid out and stepped. ``engine =
Engine.from_packs(MyPacks(...))`` serves it; ``submit``, ``step``, ``run`` and ``Result`` are
then the ones every user of `packing.serve` knows. The engine calls::

    engine                              Packs (one per served model)
    ------                              ----------------------------
    submit  -> check(request)           the request checked, copied to the host
    admit   -> fits(shape, requests)    do these requests fit this shape together?
            -> fresh(request)           a joining request's first rows, per state group
            -> member(rid, request)     (optional) the model's record of it
            -> layout(shape, requests,  index tensors and schedule tables copied into the
                      tables)           shape's buffers; each request's rows (Spans)
            -> state(shape)             (x, v_prev) per state group: the engine carries the
                                        staying requests' rows over, writes the fresh ones
            -> joined(shape, members)   (optional) a cache: claim pages, prefill; failures
                                        returned
    step    -> step(shape)              one model call + every request's solver update
            -> flags(shape)             (R,) bool: whose state went non-finite
    finish  -> result(shape, request)   (latents, action) on the device, copies
            -> then(request, ...)       (optional) a next phase that rejoins under its id
            -> left(member) / sweep     (optional) a cache: free or keep the request's rows

What an implementation must guarantee:

- Static buffers. Each shape's tensors are allocated once; ``layout`` writes a new
  composition into them with ``copy_`` (on CUDA ``non_blocking`` from pinned memory: from
  pageable memory a "non-blocking" copy may first wait for every queued kernel), so a step
  captured in a CUDA graph keeps reading the same tensors and stays right for any
  composition. Masks are built inside the step from doc ids (`masks_from_doc_ids`).
- No host sync in ``step``: no ``.item()``, ``.cpu()``, ``nonzero()`` or Python branch on a
  device value. Each request reads its own time and solver coefficients from the tables by
  its own step counter (``step_K``), which the step advances by one.
- Rows are the request's own. A request's rows (its ``Spans``) in each state group keep
  their count from one composition to the next; rows outside every request's slots (clean
  context, padding) are left exactly as they are by the update.
- ``flags`` per row of the pack: ``quarantine`` after the update flags each request whose
  state went NaN or inf and zeroes its rows, so it never reaches the next model call.
- One request's failure is that request's: ``check`` raises for a bad request (one line
  naming its field), a hook returns the members it failed (``joined``), a non-finite state is
  flagged; the engine then fails that request alone (``Result.error``), never the pack. A
  model call that raises is re-run by the engine with the pack split until the culprit is
  alone, so ``step`` must leave the state untouched when the model raises (compute the
  update, then write it).

Required: the attributes ``shapes`` (smallest first), ``device``, ``max_steps``, ``steps`` and
the methods ``check``, ``fresh``, ``layout``, ``state``, ``step``, ``flags``, ``result``.
Optional: ``fits`` (default: ``shape.fits(requests)``), ``warm_keys`` (default: each shape's
step) and the hooks ``member``, ``joined``, ``left``, ``end_session``, ``sweep``, ``then``,
``stats``, which do nothing by default. tests/test_serve_protocol.py implements a small model
from scratch and proves it packed equals alone; docs/serving-your-model.md walks through it.

The names:

- `Packs`, `Spans`, `Member`: the protocol, a request's rows, what the hooks see of a request.
- `Steps`: a model's step functions by key, run plainly or captured once in CUDA graphs.
- `quarantine`: the non-finite flags and zeroing a step ends with.
- `masks_from_doc_ids`, `FLEX_KERNEL_OPTIONS`: a step's attention masks from doc ids, and the
  FlexAttention kernel options every served mask uses.
- `check_request_tensor`, `check_seed`, `host_copy`, `SEED_MAX`: the checks a request type
  runs on its tensors and seed, and the copy ``check`` keeps.
- `to_host`, `MAX_ACTIONS`, `MAX_FRAMES`, `MAX_STEPS`: for an adapter in front of an engine
  (`packing.server`): a `Result`'s tensor read without waiting for the next model call, and
  the largest sizes an engine takes.
"""

from packing.serve._device import quarantine, to_host
from packing.serve._limits import MAX_ACTIONS, MAX_FRAMES, MAX_STEPS
from packing.serve._packs import Member, Packs, Spans
from packing.serve._request import SEED_MAX, check_request_tensor, check_seed, host_copy
from packing.serve._step import FLEX_KERNEL_OPTIONS, Steps, masks_from_doc_ids

__all__ = [
    "FLEX_KERNEL_OPTIONS",
    "MAX_ACTIONS",
    "MAX_FRAMES",
    "MAX_STEPS",
    "SEED_MAX",
    "Member",
    "Packs",
    "Spans",
    "Steps",
    "check_request_tensor",
    "check_seed",
    "host_copy",
    "masks_from_doc_ids",
    "quarantine",
    "to_host",
]
