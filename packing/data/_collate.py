"""Collate: K whole episodes -> one `PackedBatch`, and back.

Each episode is a dict: tensors with the sequence axis first are *streams*; 0-d tensors,
numbers and strings are *per-episode values*. Three episodes of 2, 4 and 3 steps::

    batch["x"]          x0 x0 x1 x1 x1 x1 x2 x2 x2 .  .  .     (tail padding only)
    batch["doc_ids"]     0  0  1  1  1  1  2  2  2 -1 -1 -1
    batch["position_ids"]0  1  0  1  2  3  0  1  2  0  0  0
    batch["cu_seqlens"] [0, 2, 6, 9]     batch["max_seqlen"] 4

Copies go straight into one preallocated (optionally pinned) buffer per stream; the layout is
built with a handful of vectorised ops, never per token in Python.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info as _get_worker_info

from packing._layout_math import padded_length
from packing._validate import (
    check_bool,
    check_finite,
    check_int,
    check_int_tuple,
    check_optional_int,
    check_real,
    check_sequence,
)
from packing.data._joint import joint_layout as _joint_layout
from packing.data._layout import PackedBatch, StreamLayout, layout_from_lengths

__all__ = ["MAX_PACK_TOKENS", "PackedCollator", "Stream", "check_batch", "pack", "unpack"]

# A pack is allocated at its budget: 2**27 tokens (134 M; a real step holds ~0.3 M a GPU) is
# refused when the collator is built, not by the allocator after a DataLoader worker started.
MAX_PACK_TOKENS = 2**27


@dataclass(frozen=True)
class Stream:
    """A sequence stream of an episode.

    ``grid=(h, w)`` says each step becomes ``h * w`` tokens in row-major (t, h, w) order and
    gives the stream 3D positions: a 48x8x16 latent frame with 2x2 patches is ``grid=(4, 8)``.
    ``tokens_per_step`` is then ``h * w``. ``budget`` is the stream's static padded length in
    tokens (a multiple of ``tokens_per_step``). ``step_shape``/``dtype`` declare what one step
    holds; they are checked, and they let an empty pack become an all-padding batch.
    """

    name: str
    _: KW_ONLY
    tokens_per_step: int = 1
    grid: tuple[int, int] | None = None
    budget: int | None = None
    step_shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None
    pad_value: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Stream name must be a non-empty string, got {self.name!r}")
        where = f"stream {self.name!r}: "
        check_int(where + "tokens_per_step", self.tokens_per_step, min=1)
        check_optional_int(
            where + "budget", self.budget, min=1, max=MAX_PACK_TOKENS, hint="tokens a pack"
        )
        if self.dtype is not None and not isinstance(self.dtype, torch.dtype):
            raise TypeError(
                f"{where}dtype={self.dtype!r} must be a torch.dtype, e.g. torch.float16"
            )
        if not isinstance(self.pad_value, bool):
            check_real(where + "pad_value", self.pad_value)
        if self.grid is not None:
            # Stream(grid=(2.0, 2)) would reach torch's arange as a float much later.
            h, w = check_int_tuple(where + "grid", self.grid, length=2, min=1)
            object.__setattr__(self, "grid", (h, w))
            if h < 1 or w < 1:
                raise ValueError(f"stream {self.name!r}: grid {self.grid} must be positive")
            if self.tokens_per_step not in (1, h * w):
                raise ValueError(
                    f"stream {self.name!r}: tokens_per_step={self.tokens_per_step} disagrees "
                    f"with grid {self.grid} ({h * w} tokens); give one of them"
                )
            object.__setattr__(self, "tokens_per_step", h * w)
        if self.budget is not None and (self.budget < 1 or self.budget % self.tokens_per_step != 0):
            raise ValueError(
                f"stream {self.name!r}: budget={self.budget} must be a positive multiple of "
                f"tokens_per_step={self.tokens_per_step}"
            )
        if self.step_shape is not None:
            dims = tuple(check_sequence(where + "step_shape", self.step_shape))
            if not all(isinstance(s, int | np.integer) and not isinstance(s, bool) for s in dims):
                raise TypeError(
                    f"stream {self.name!r}: step_shape={self.step_shape!r} must hold ints "
                    "(a 2.5 would be truncated)"
                )
            object.__setattr__(self, "step_shape", tuple(int(s) for s in dims))
        if self.dtype is not None:
            _check_pad_value(self.name, self.pad_value, self.dtype)


def _check_pad_value(stream: str, value: float, dtype: torch.dtype) -> None:
    """A pad value the stream's dtype holds exactly: 1.5 on an int stream would become 1, 1e6
    on a float16 stream inf."""
    if dtype.is_floating_point or dtype.is_complex:
        if dtype.is_floating_point and abs(value) > torch.finfo(dtype).max:
            raise ValueError(
                f"stream {stream!r}: pad_value={value!r} is out of the range of its dtype "
                f"{dtype} (max {torch.finfo(dtype).max:g}; it would be stored as inf); pick a "
                "pad value the dtype holds, e.g. 0"
            )
        return
    exact = float(value).is_integer() if dtype != torch.bool else value in (0, 1)
    if exact and dtype != torch.bool:
        info = torch.iinfo(dtype)
        exact = info.min <= value <= info.max
    if not exact:
        raise ValueError(
            f"stream {stream!r}: pad_value={value!r} does not fit its dtype {dtype} (it would be "
            "stored as another value); pick a pad value the dtype holds, e.g. 0"
        )


def _as_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        if not value.dtype.isnative:  # torch reads native byte order only
            raise TypeError(
                f"a numpy array of byte order {value.dtype.byteorder!r} ({value.dtype.str}); "
                "convert it to the native order first (array.astype(array.dtype.newbyteorder('='))"
            )
        return torch.from_numpy(value)
    return None


_KINDS = {int: "int", float: "float", bool: "bool", str: "object", torch.Tensor: "tensor"}


def _kind(value: Any) -> str:
    """How a per-episode value is stacked, and restored by `unpack`."""
    kind = _KINDS.get(type(value))  # the common types without ABC isinstance checks
    if kind is not None:
        return kind
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, bool | np.bool_):
        return "bool"
    if isinstance(value, numbers.Integral):
        return "int"
    if isinstance(value, numbers.Real):
        return "float"
    return "object"  # strings and anything else: kept as a list


class PackedCollator:
    """``DataLoader(..., collate_fn=PackedCollator(...))``: K episodes -> one `PackedBatch`.

    Args:
        streams: the sequence streams, primary first (names or `Stream`). ``None``: every
            tensor with at least one dimension is a stream, all of the episode's length.
        token_budget: static padded length (tokens) of the primary stream.
        pad_to_multiple: streams without a budget are padded to a multiple of this (and of
            their tokens_per_step), so shapes come from a few buckets. 1 disables padding.
        max_docs: static number of documents: per-episode tensors and ``cu_seqlens`` are
            padded to it (episode_index with -1, numbers with 0, strings with "").
        joint: tuples of stream names to lay out as one attention sequence in the worker
            (see `packing.data._joint.joint_layout`); cached on the batch (`PackedBatch.joint_layouts`).
        pin_memory: allocate the output buffers in pinned memory.
        check_finite: refuse a stream value holding NaN or inf, naming the episode, the stream
            and the first bad index (one reduction per tensor; off by default, on in verify).
    """

    def __init__(
        self,
        streams: Sequence[Stream | str] | None = None,
        *,
        token_budget: int | None = None,
        pad_to_multiple: int = 128,
        max_docs: int | None = None,
        joint: Sequence[Sequence[str]] = (),
        pin_memory: bool = False,
        check_finite: bool = False,
    ) -> None:
        pad_to_multiple = check_int(
            "pad_to_multiple",
            pad_to_multiple,
            min=1,
            max=MAX_PACK_TOKENS,
            hint="tokens; 1 disables padding",
        )
        max_docs = check_optional_int("max_docs", max_docs, min=1, hint="episodes per pack")
        token_budget = check_optional_int(
            "token_budget", token_budget, min=1, max=MAX_PACK_TOKENS, hint="tokens a pack"
        )
        self.check_finite = check_bool("check_finite", check_finite)
        pin_memory = check_bool("pin_memory", pin_memory)
        decl = (
            None
            if streams is None
            else [
                Stream(s) if isinstance(s, str) else s
                for s in check_sequence("streams", streams, of=(Stream, str))
            ]
        )
        if decl is not None:
            if not decl:
                raise ValueError("streams=[] declares no stream; pass None to infer them")
            names = [s.name for s in decl]
            if len(set(names)) != len(names):
                raise ValueError(f"stream names must be unique, got {names}")
            if token_budget is not None:
                p = decl[0]
                if p.budget is not None and p.budget != token_budget:
                    raise ValueError(
                        f"token_budget={token_budget} disagrees with Stream({p.name!r}, "
                        f"budget={p.budget}); give one of them"
                    )
                decl[0] = Stream(
                    p.name, tokens_per_step=p.tokens_per_step, grid=p.grid, budget=token_budget,
                    step_shape=p.step_shape, dtype=p.dtype, pad_value=p.pad_value,
                )  # fmt: skip
        self.streams = decl
        self.token_budget = token_budget
        self.pad_to_multiple = pad_to_multiple
        self.max_docs = max_docs
        self.joint = [
            tuple(check_sequence(f"joint[{i}]", j, of=str))
            for i, j in enumerate(check_sequence("joint", joint))
        ]
        self.pin_memory = pin_memory

    def __repr__(self) -> str:
        return (
            f"PackedCollator(streams={self.streams}, token_budget={self.token_budget}, "
            f"pad_to_multiple={self.pad_to_multiple}, max_docs={self.max_docs})"
        )

    # -- the one public call ----------------------------------------------------------------
    def __call__(self, episodes: Sequence[Mapping[str, Any]]) -> PackedBatch:
        columns = self._plain_columns(episodes)
        if columns is None:  # not a plain pack: the detailed checks name what is wrong
            columns = self._checked_columns(episodes)
        if not columns:
            return self._empty()
        names = {s.name for s, _ in columns}
        data: dict[str, torch.Tensor] = {}
        layouts: dict[str, StreamLayout] = {}
        for s, tensors in columns:
            if self.check_finite:
                for i, t in enumerate(tensors):
                    check_finite(f"episode {_name(episodes[i], i)}", s.name, t)
            data[s.name], layouts[s.name] = self._copy_stream(s, episodes, tensors)
        try:
            per_episode, kinds, ids = self._stack_values(episodes, names)
        except KeyError:  # the lean path compares key counts only: name the missing key
            self._check_keys(episodes)
            raise
        batch = PackedBatch(
            streams=data,
            layouts=layouts,
            per_episode=per_episode,
            primary=columns[0][0].name,
            value_kinds=kinds,
            host_episode_ids=ids,
        )
        for j in self.joint:
            _joint_layout(batch, j)  # cached on the batch
        return batch

    def _plain_columns(
        self, episodes: Sequence[Mapping[str, Any]]
    ) -> list[tuple[Stream, list[torch.Tensor]]] | None:
        """Each stream with its K tensors, when the pack is plain: a non-empty list of dicts
        with as many keys each, within ``max_docs``, every stream value a torch tensor of
        >= 1 step and of its stream's dtype (see `_plain_tensors`). ``None`` otherwise (numpy
        arrays, a bad pack): `_checked_columns` then converts or raises, naming the episode.

        One pass per pack, no error formatting; what a DataLoader gives on every step. Dicts
        of as many keys hold the same keys unless one lacks a key of the first, which the
        reads of the streams or of the per-episode values then find (a KeyError, named by
        `_check_keys`); counting keys touches only each dict's header, not its key table.
        """
        if type(episodes) not in (list, tuple) or not episodes:
            return None
        if self.max_docs is not None and len(episodes) > self.max_docs:
            return None
        first = episodes[0]
        if type(first) is not dict:
            return None
        n = len(first)
        if not all(type(ep) is dict and len(ep) == n for ep in episodes):
            return None
        streams = self.streams if self.streams is not None else self._resolve_streams(episodes)
        columns = []
        try:
            for s in streams:
                tensors = [ep[s.name] for ep in episodes]
                if not _plain_tensors(s, tensors):
                    return None
                columns.append((s, tensors))
        except KeyError:
            return None
        return columns

    def _checked_columns(
        self, episodes: Sequence[Mapping[str, Any]]
    ) -> list[tuple[Stream, list[torch.Tensor]]]:
        """`_plain_columns` for any input: converts numpy streams to tensors and raises on a
        bad pack with an error naming the episode and key. ``[]`` for an empty pack."""
        if not isinstance(episodes, Sequence) or isinstance(episodes, str | bytes):
            raise TypeError(f"expected a list of episode dicts, got {type(episodes).__name__}")
        if len(episodes) == 0:
            return []
        for i, ep in enumerate(episodes):
            if not isinstance(ep, Mapping):
                raise TypeError(f"episode {i} is a {type(ep).__name__}, expected a dict")
        if self.max_docs is not None and len(episodes) > self.max_docs:
            raise ValueError(
                f"pack has {len(episodes)} episodes > max_docs={self.max_docs}; plan packs "
                f"with max_docs (packing.planning._plan.plan_packs(..., max_docs={self.max_docs}))"
            )
        streams = self._resolve_streams(episodes)
        self._check_keys(episodes)
        return [(s, self._stream_tensors(s, episodes)) for s in streams]

    # -- streams ----------------------------------------------------------------------------
    def _resolve_streams(self, episodes: Sequence[Mapping[str, Any]]) -> list[Stream]:
        if self.streams is not None:
            for i, ep in enumerate(episodes):
                for s in self.streams:
                    if s.name not in ep:
                        raise KeyError(
                            f"episode {_name(ep, i)} has no stream {s.name!r}; its keys are "
                            f"{sorted(ep)}"
                        )
            return list(self.streams)
        first = episodes[0]
        keys = [k for k, v in first.items() if (t := _as_tensor(v)) is not None and t.dim() >= 1]
        if not keys:
            raise ValueError(
                f"episode {_name(first, 0)} has no tensor with a sequence axis (keys: "
                f"{sorted(first)}); streams are tensors shaped (steps, ...)"
            )
        for i, ep in enumerate(episodes):
            lengths = {}
            for k in keys:
                t = _as_tensor(ep.get(k))
                lengths[k] = None if t is None or t.dim() == 0 else int(t.shape[0])
            if len(set(lengths.values())) > 1:
                raise ValueError(
                    f"episode {_name(ep, i)}: streams have different lengths {lengths}; "
                    f"declare them, e.g. PackedCollator(streams=[Stream({keys[0]!r}), "
                    f"Stream({keys[1]!r})]) so each gets its own layout"
                )
        budget = self.token_budget
        return [Stream(k, budget=budget if n == 0 else None) for n, k in enumerate(keys)]

    def _check_keys(self, episodes: Sequence[Mapping[str, Any]]) -> None:
        ref = set(episodes[0])
        for i, ep in enumerate(episodes[1:], start=1):
            if set(ep) != ref:
                missing, extra = sorted(ref - set(ep)), sorted(set(ep) - ref)
                raise KeyError(
                    f"episode {_name(ep, i)} has different keys than episode "
                    f"{_name(episodes[0], 0)}: missing {missing}, extra {extra}; every "
                    f"episode of a pack must carry the same keys"
                )

    def _padded_tokens(self, s: Stream, tokens: int) -> int:
        if s.budget is not None:
            return s.budget
        m = math.lcm(self.pad_to_multiple, s.tokens_per_step)
        return padded_length(tokens, m)

    def _stream_tensors(
        self, s: Stream, episodes: Sequence[Mapping[str, Any]]
    ) -> list[torch.Tensor]:
        """The K tensors of stream ``s``, checked (numpy arrays converted)."""
        tensors = [ep[s.name] for ep in episodes]
        return tensors if _plain_tensors(s, tensors) else self._checked_tensors(s, episodes)

    def _checked_tensors(
        self, s: Stream, episodes: Sequence[Mapping[str, Any]]
    ) -> list[torch.Tensor]:
        tensors: list[torch.Tensor] = []
        for i, ep in enumerate(episodes):
            try:
                t = _as_tensor(ep[s.name])
            except TypeError as e:  # a numpy array torch cannot hold (strings, objects)
                raise TypeError(
                    f"episode {_name(ep, i)} stream {s.name!r} is a numpy array of "
                    f"{ep[s.name].dtype}, which has no torch dtype; store numbers ({e})"
                ) from e
            if t is None or t.dim() == 0:
                raise TypeError(
                    f"episode {_name(ep, i)} stream {s.name!r} is "
                    f"{type(ep[s.name]).__name__}, expected a tensor shaped (steps, ...)"
                )
            if t.shape[0] == 0:
                raise ValueError(
                    f"episode {_name(ep, i)} has 0 steps in stream {s.name!r}; remove empty "
                    f"episodes before packing (nothing is dropped silently)"
                )
            if t.requires_grad:
                raise ValueError(
                    f"episode {_name(ep, i)} stream {s.name!r} requires grad; episodes are "
                    f"data, copied into the pack without autograd: pass {s.name}.detach() (or "
                    "build it under torch.no_grad())"
                )
            if not t.is_cpu:
                raise ValueError(
                    f"episode {_name(ep, i)} stream {s.name!r} is on {t.device}; packs are "
                    f"built in host memory (DataLoader workers, pinned buffers): keep "
                    f"episodes on the CPU and move the pack with batch.to(device)"
                )
            ref = tensors[0] if tensors else None
            want_shape = s.step_shape if s.step_shape is not None else (
                None if ref is None else tuple(ref.shape[1:]))  # fmt: skip
            want_dtype = s.dtype if s.dtype is not None else (None if ref is None else ref.dtype)
            if want_shape is not None and tuple(t.shape[1:]) != want_shape:
                raise ValueError(
                    f"episode {_name(ep, i)} stream {s.name!r} has steps of shape "
                    f"{tuple(t.shape[1:])}, expected {want_shape}; every episode of a stream "
                    f"must have the same trailing shape"
                )
            if want_dtype is not None and t.dtype != want_dtype:
                raise TypeError(
                    f"episode {_name(ep, i)} stream {s.name!r} has dtype {t.dtype}, expected "
                    f"{want_dtype}; convert it in the dataset (packing never casts silently)"
                )
            tensors.append(t)
        return tensors

    def _copy_stream(
        self, s: Stream, episodes: Sequence[Mapping[str, Any]], tensors: list[torch.Tensor]
    ) -> tuple[torch.Tensor, StreamLayout]:
        steps = [t.shape[0] for t in tensors]
        tps = s.tokens_per_step
        rows = sum(steps)
        padded = self._padded_tokens(s, rows * tps)
        lengths = steps if tps == 1 else [n * tps for n in steps]
        if rows * tps > padded:
            raise _over_budget(s, episodes, lengths, padded)
        if s.dtype is None:
            _check_pad_value(s.name, s.pad_value, tensors[0].dtype)
        out = _output_buffer(tensors[0], (padded // tps, *tensors[0].shape[1:]), self.pin_memory)
        try:
            torch.cat(tensors, dim=0, out=out if rows == out.shape[0] else out[:rows])
        except RuntimeError:  # trailing shapes differ: name the episode
            self._checked_tensors(s, episodes)
            raise
        if rows < out.shape[0]:
            out[rows:].fill_(s.pad_value)
        layout = layout_from_lengths(lengths, steps, padded, tps, s.grid, self.max_docs)
        return out, layout

    # -- per-episode values -------------------------------------------------------------------
    def _stack_values(
        self, episodes: Sequence[Mapping[str, Any]], stream_names: set[str]
    ) -> tuple[dict[str, Any], dict[str, str], tuple[int, ...]]:
        """Every non-stream key stacked per document (padded to ``max_docs``), how each was
        given (`_kind`), and the K episode indices as host ints."""
        k_real = len(episodes)
        k_out = self.max_docs or k_real
        out: dict[str, Any] = {}
        kinds: dict[str, str] = {}
        plain_ids: tuple[int, ...] | None = None  # episode_index given as Python ints
        for key in episodes[0]:
            if key in stream_names:
                continue
            values = [ep[key] for ep in episodes]
            fill = -1 if key == "episode_index" else 0
            stacked = _stack_plain(values, k_out, fill)
            if stacked is None:
                kinds[key], out[key] = _stack_checked(key, values, episodes, k_out, fill)
            else:
                kinds[key], out[key] = stacked
                if fill and stacked[0] == "int":  # `_stack_plain`: all of type int
                    plain_ids = tuple(values)
        if "episode_index" not in out:
            # No identity given: the position in the pack. Per-episode noise is keyed by
            # episode_index, so datasets should provide it (LeRobotEpisodes does).
            ids = tuple(range(k_real))
            out["episode_index"] = torch.tensor(ids + (-1,) * (k_out - k_real))
            kinds["episode_index"] = "absent"
            return out, kinds, ids
        index = out["episode_index"]
        if plain_ids is not None and min(plain_ids) >= 0:
            _check_unique(plain_ids)
            return out, kinds, plain_ids  # the common case, without the checks' torch calls
        _check_episode_index(index, kinds["episode_index"], episodes)
        if index.dtype != torch.int64:
            out["episode_index"] = index = index.to(torch.int64)
        return out, kinds, tuple(index[:k_real].tolist())

    def _empty(self) -> PackedBatch:
        """An all-padding pack: what a rank gets when there are fewer episodes than ranks."""
        if self.streams is None or any(
            s.step_shape is None or s.dtype is None for s in self.streams
        ):
            raise ValueError(
                "empty pack: got no episodes. If a distributed sampler gave this rank no "
                "episode (fewer episodes than ranks), declare every stream with step_shape and "
                "dtype, e.g. Stream('latents', step_shape=(48, 8, 16), dtype=torch.float16), "
                "so the collator can emit an all-padding pack with zero loss weight"
            )
        data, layouts = {}, {}
        for s in self.streams:
            padded = self._padded_tokens(s, 0)
            assert s.step_shape is not None and s.dtype is not None
            data[s.name] = torch.full(
                (padded // s.tokens_per_step, *s.step_shape), s.pad_value, dtype=s.dtype
            )
            layouts[s.name] = layout_from_lengths(
                [], [], padded, s.tokens_per_step, s.grid, self.max_docs
            )
        k_out = self.max_docs or 0
        return PackedBatch(
            streams=data,
            layouts=layouts,
            per_episode={"episode_index": torch.full((k_out,), -1, dtype=torch.int64)},
            primary=self.streams[0].name,
            value_kinds={"episode_index": "absent"},
            host_episode_ids=(),
        )


def _plain_tensors(s: Stream, tensors: list[Any]) -> bool:
    """Every value a torch tensor of >= 1 step and of one dtype, the first of the stream's
    trailing shape (declared, or its own): the common case, checked without formatting.

    That the others share the first's trailing shape is left to ``torch.cat``, which raises
    if they do not (`PackedCollator._copy_stream` then names the episode)."""
    first = tensors[0]
    if type(first) is not torch.Tensor or first.dim() == 0:
        return False
    dtype = first.dtype if s.dtype is None else s.dtype
    if s.step_shape is not None and first.shape[1:] != s.step_shape:
        return False
    tensor = torch.Tensor
    if not all(
        type(t) is tensor and t.dtype is dtype and t.dim() > 0 and t.is_cpu and not t.requires_grad
        for t in tensors
    ):
        return False
    return min(t.shape[0] for t in tensors) > 0


def _over_budget(
    s: Stream, episodes: Sequence[Mapping[str, Any]], lengths: list[int], padded: int
) -> ValueError:
    """The error for a pack whose stream ``s`` has more tokens than its padded length."""
    worst = int(np.argmax(lengths))
    hint = (
        f"episode {_name(episodes[worst], worst)} alone has {lengths[worst]:,} tokens; "
        if lengths[worst] > padded
        else ""
    )
    return ValueError(
        f"pack has {sum(lengths):,} tokens in stream {s.name!r} > budget={padded:,} "
        f"(episode lengths {lengths}); {hint}plan packs under the budget with "
        f"packing.planning._plan.plan_packs(lengths, token_budget) or raise the budget"
    )


_VALUE_DTYPES = {"int": torch.int64, "float": torch.float64, "bool": torch.bool}


def _stack_plain(values: list[Any], k_out: int, fill: int) -> tuple[str, Any] | None:
    """``(kind, stacked)`` when all K values are of one plain type (int, float, bool, str):
    numbers become one (k_out,) tensor padded with ``fill``, strings a list padded with "".
    ``None`` for anything else (tensors, numpy scalars, mixed types): see `_stack_checked`."""
    t0 = type(values[0])
    kind = _KINDS.get(t0)
    if kind is None or kind == "tensor" or not all(type(v) is t0 for v in values):
        return None
    if kind == "int" and not (min(values) >= -(2**63) and max(values) < 2**63):
        return None  # outside int64: `_stack_checked` names the episode and the key
    pad = k_out - len(values)
    if kind == "object":
        return kind, values + [""] * pad
    return kind, torch.tensor(values + [fill] * pad if pad else values, dtype=_VALUE_DTYPES[kind])


def _stack_checked(
    key: str, values: list[Any], episodes: Sequence[Mapping[str, Any]], k_out: int, fill: int
) -> tuple[str, Any]:
    """``(kind, stacked)`` for values of any kind, checked: one type across episodes (numbers
    of different Python types count as one kind), tensors of one shape and dtype."""
    kind = _kind(values[0])
    for i, v in enumerate(values):
        if _kind(v) != kind:
            raise TypeError(
                f"episode {_name(episodes[i], i)} key {key!r} is "
                f"{type(v).__name__} but episode {_name(episodes[0], 0)} has "
                f"{type(values[0]).__name__}; per-episode values must share a type"
            )
    if kind == "tensor":
        ts = [_as_tensor(v) for v in values]
        shapes = {tuple(t.shape) for t in ts if t is not None}
        dtypes = {t.dtype for t in ts if t is not None}
        if len(shapes) > 1 or len(dtypes) > 1:
            raise ValueError(
                f"per-episode value {key!r} has shapes {sorted(shapes)} / dtypes "
                f"{sorted(map(str, dtypes))} across episodes; declare it as a Stream "
                f"if it has a sequence axis"
            )
        stacked = torch.stack([t for t in ts if t is not None])
        return kind, _pad_rows(stacked, k_out, fill=fill)
    if kind == "int":  # torch would fail inside its own conversion, naming nothing
        big = next((i for i, v in enumerate(values) if not -(2**63) <= v < 2**63), None)
        if big is not None:
            raise ValueError(
                f"episode {_name(episodes[big], big)} key {key!r} is {values[big]}, outside "
                "int64; per-episode ints are stored as int64"
            )
    if kind in _VALUE_DTYPES:
        return kind, _pad_rows(torch.tensor(values, dtype=_VALUE_DTYPES[kind]), k_out, fill=fill)
    return kind, list(values) + [""] * (k_out - len(values))


def _check_episode_index(index: Any, kind: str, episodes: Sequence[Mapping[str, Any]]) -> None:
    """episode_index is an int >= 0 per episode: -1 marks padding documents, and a float
    would be truncated into another episode's noise and timestep keys."""
    if kind not in ("int", "tensor") or (
        isinstance(index, torch.Tensor)
        and (index.dtype.is_floating_point or index.dtype == torch.bool or index.dim() != 1)
    ):
        raise TypeError(
            f"episode_index must be an int per episode, got {type(episodes[0]['episode_index']).__name__}"
            f" ({episodes[0]['episode_index']!r} in episode 0); it keys per-episode noise"
        )
    real = index[: len(episodes)]
    if bool((real < 0).any()):
        i = int((real < 0).nonzero()[0])
        raise ValueError(
            f"episode {i} has episode_index {int(real[i])}; episode indices are >= 0 (-1 marks "
            "padding documents): renumber the episodes"
        )
    _check_unique(tuple(real.tolist()))


def _check_unique(ids: tuple[int, ...]) -> None:
    """Two episodes of one pack with one episode_index would draw identical noise."""
    if len(set(ids)) != len(ids):
        first = next(i for i, e in enumerate(ids) if ids.index(e) != i)
        raise ValueError(
            f"episodes {ids.index(ids[first])} and {first} of this pack both have episode_index "
            f"{ids[first]}; episode_index keys each episode's noise and timestep, so the two "
            "would get identical noise: give each episode its own episode_index (a split "
            "episode's pieces belong in different packs)"
        )


def _output_buffer(like: torch.Tensor, shape: tuple[int, ...], pin: bool) -> torch.Tensor:
    """A fresh buffer for a packed stream.

    In a DataLoader worker it is allocated in shared memory, as ``default_collate`` does: the
    batch then reaches the main process without the extra copy into shared memory that
    pickling an ordinary tensor costs (a full second pass over the pack). Elsewhere a buffer
    of > 32 MiB is a numpy array's memory (for its huge pages), smaller ones torch's.
    """
    if pin or like.device.type != "cpu":
        return torch.empty(shape, dtype=like.dtype, pin_memory=pin)
    if _get_worker_info() is not None:
        storage = like._typed_storage()._new_shared(math.prod(shape), device=like.device)
        return like.new(storage).view(shape)
    nbytes = math.prod(shape) * like.element_size()
    if nbytes > _HUGE_PAGE_BYTES and like.dtype in _NUMPY_BACKED:
        # numpy asks the kernel for transparent huge pages on arrays of >= 4 MiB
        # (madvise), torch's allocator does not: filling a fresh 48 MB buffer took ~540
        # page faults instead of ~12,300 on the development VM (THP "madvise"). Only above
        # glibc's largest mmap threshold (32 MiB) is every buffer a fresh mapping that
        # faults; below it malloc reuses the freed heap without faults, and there numpy's
        # buffer (its madvise, its extra calls) measured 2-10% slower than torch's.
        return torch.from_numpy(np.empty(nbytes, dtype=np.uint8)).view(like.dtype).view(shape)
    return torch.empty(shape, dtype=like.dtype)


_HUGE_PAGE_BYTES = 32 * 2**20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
_NUMPY_BACKED = {
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8,
    torch.int16, torch.int32, torch.int64, torch.bool,
}  # fmt: skip


def _name(ep: Mapping[str, Any], i: int) -> str:
    """'2' or '2 (episode_index 17)': the position in the pack and the dataset identity."""
    idx = ep.get("episode_index") if isinstance(ep, Mapping) else None
    if isinstance(idx, torch.Tensor) and idx.numel() == 1:
        idx = int(idx)
    return f"{i} (episode_index {idx})" if isinstance(idx, numbers.Integral) else str(i)


def _pad_rows(t: torch.Tensor, rows: int, fill: float) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    pad = torch.full((rows - t.shape[0], *t.shape[1:]), fill, dtype=t.dtype)
    return torch.cat([t, pad])


def pack(episodes: Sequence[Mapping[str, Any]], **kwargs: Any) -> PackedBatch:
    """Functional form: ``pack(episodes, **kw) == PackedCollator(**kw)(episodes)``."""
    return PackedCollator(**kwargs)(episodes)


def unpack(batch: PackedBatch) -> list[dict[str, Any]]:
    """The episodes back, exactly as they went in (same keys, values, dtypes and types).

    Stream values are views into the batch's buffers; clone them to keep them past the batch.
    A batch whose layouts and buffers disagree (edited by hand, or mixed from two batches) is
    refused rather than read as wrong rows; see `check_batch`.
    """
    if not isinstance(batch, PackedBatch):
        raise TypeError(
            f"unpack takes the PackedBatch a PackedCollator built, got {type(batch).__name__}"
        )
    check_batch(batch)
    kinds = batch.value_kinds
    episodes: list[dict[str, Any]] = [{} for _ in range(batch.num_docs)]
    for name, data in batch.streams.items():
        lay = batch.layouts[name]
        start = 0
        for k, n in enumerate(lay.steps_K):
            episodes[k][name] = data[start : start + n]
            start += n
    for key, values in batch.per_episode.items():
        kind = kinds.get(key, "tensor")
        if kind == "absent":
            continue
        for k in range(batch.num_docs):
            v = values[k]
            if kind in ("int", "float", "bool"):
                v = v.item()
            episodes[k][key] = v
    return episodes


def check_batch(batch: PackedBatch) -> None:
    """Raise unless every stream's layout agrees with its buffer and with the other streams.

    Per stream: K documents of >= 1 step, ``lengths_K == steps_K * tokens_per_step``, the
    steps fit the buffer's rows and the padded length is ``rows * tokens_per_step``; on CPU
    also ``doc_ids_T`` (``0 0 1 1 1 2 ... -1 -1``) and ``cu_seqlens_K1`` match the lengths
    (on an accelerator reading them would be a sync). Every per-episode value has K rows.
    """
    k = batch.num_docs
    for name, data in batch.streams.items():
        if name not in batch.layouts:
            raise ValueError(f"stream {name!r} has data but no layout in this PackedBatch")
        lay = batch.layouts[name]
        tps = lay.tokens_per_step
        where = f"stream {name!r}"
        if lay.num_docs != k or len(lay.steps_K) != k:
            raise ValueError(
                f"{where} lays out {len(lay.steps_K)} documents but the batch has {k}; every "
                "stream of a pack holds the same episodes: build the batch with PackedCollator"
            )
        if any(n < 1 for n in lay.steps_K):
            raise ValueError(f"{where}: a document has 0 steps (steps_K {list(lay.steps_K)})")
        if [n * tps for n in lay.steps_K] != list(lay.lengths_K):
            raise ValueError(
                f"{where}: lengths_K {list(lay.lengths_K)} != steps_K {list(lay.steps_K)} x "
                f"{tps} tokens per step"
            )
        rows = int(data.shape[0]) if data.dim() else 0
        if sum(lay.steps_K) > rows or lay.padded_len != rows * tps:
            raise ValueError(
                f"{where}: the layout has {sum(lay.steps_K)} real steps padded to "
                f"{lay.padded_len} tokens, but the buffer has {rows} rows of {tps} tokens; "
                "the layout was not built for this buffer"
            )
        if lay.doc_ids_T.device.type == "cpu":
            want = layout_from_lengths(list(lay.lengths_K), list(lay.steps_K), lay.padded_len, tps)
            cu = lay.cu_seqlens_K1[: k + 1]
            if not torch.equal(lay.doc_ids_T.long(), want.doc_ids_T.long()) or not torch.equal(
                cu.long(), want.cu_seqlens_K1[: k + 1].long()
            ):
                raise ValueError(
                    f"{where}: doc_ids/cu_seqlens do not match lengths_K {list(lay.lengths_K)}; "
                    "the layout was edited: rebuild it with layout_from_lengths"
                )
    for key, values in batch.per_episode.items():
        if len(values) < k:
            raise ValueError(
                f"per-episode value {key!r} has {len(values)} entries for {k} documents; "
                "every per-episode value needs one entry per episode"
            )
