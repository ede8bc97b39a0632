"""The packed layout: one type, `PackedBatch`, that flows from collate to mask to loss.

Legend (used in names across the package; ``docs/index.md`` has the whole table)::

    K   documents (episodes) in a pack        T   tokens of a stream, padded (tail only)
    S   steps of a stream (frames, actions)   K1  K + 1 (boundaries)
    J   tokens of a joint sequence            N   items to plan, P packs
    doc_ids_T       int32 (T,)   document of each token, -1 on padding
    position_ids_T  int32 (T,)   token position inside its document, 0 on padding
    thw_T3          int32 (T,3)  (t, h, w) inside the document, for 3D RoPE (grid streams)
    cu_seqlens_K1   int32 (K+1,) token offsets of the documents; padding lies after cu[-1]

Three episodes of lengths ``[2, 4, 3]`` padded to ``T = 12``::

    tokens      a a b b b b c c c . . .
    doc_ids     0 0 1 1 1 1 2 2 2 -1 -1 -1
    position    0 1 0 1 2 3 0 1 2  0  0  0
    cu_seqlens  [0, 2, 6, 9]      max_seqlen 4

A stream whose steps expand to several tokens (a latent frame of 8x16 with 2x2 patches is a
``grid=(4, 8)`` of 32 tokens) keeps its data at step level (``batch["latents"]`` is
``(S, C, H, W)``) while its layout is at token level, in (t, h, w) row-major order.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from packing._layout_math import layout_arrays
from packing._validate import (
    check_bool,
    check_device,
    check_int,
    check_int_tuple,
    check_optional_int,
    check_sequence,
)

__all__ = ["JointLayout", "PackedBatch", "StreamLayout", "layout_from_lengths"]


@dataclass(frozen=True)
class StreamLayout:
    """Where each document of one stream lies, at token level.

    ``lengths_K`` and ``steps_K`` are plain Python lists so that no code that reads them
    needs a device sync; the tensors live wherever the batch was moved.
    """

    doc_ids_T: torch.Tensor
    position_ids_T: torch.Tensor
    cu_seqlens_K1: torch.Tensor
    max_seqlen: int
    lengths_K: tuple[int, ...]
    steps_K: tuple[int, ...]
    tokens_per_step: int = 1
    grid: tuple[int, int] | None = None
    thw_T3: torch.Tensor | None = None

    @property
    def num_docs(self) -> int:
        return len(self.lengths_K)

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens."""
        return sum(self.lengths_K)

    @property
    def padded_len(self) -> int:
        return int(self.doc_ids_T.shape[0])

    @property
    def efficiency(self) -> float:
        """Real tokens over padded tokens."""
        return self.num_tokens / max(self.padded_len, 1)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> StreamLayout:
        device = check_device("device", device)
        check_bool("non_blocking", non_blocking)

        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return replace(
            self,
            doc_ids_T=self.doc_ids_T.to(device, non_blocking=non_blocking),
            position_ids_T=self.position_ids_T.to(device, non_blocking=non_blocking),
            cu_seqlens_K1=self.cu_seqlens_K1.to(device, non_blocking=non_blocking),
            thw_T3=mv(self.thw_T3),
        )

    def pin_memory(self) -> StreamLayout:
        def pin(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.pin_memory()

        return replace(
            self,
            doc_ids_T=self.doc_ids_T.pin_memory(),
            position_ids_T=self.position_ids_T.pin_memory(),
            cu_seqlens_K1=self.cu_seqlens_K1.pin_memory(),
            thw_T3=pin(self.thw_T3),
        )


@dataclass(frozen=True)
class JointLayout:
    """Several token-level streams laid out as one sequence, each episode's tokens contiguous.

    Streams V (video) and A (action) of episodes 0 and 1, padded tails v. and a.::

        V: v0 v0 v0 v1 v1 .        A: a0 a1 a1 .
        joint: v0 v0 v0 a0 | v1 v1 a1 a1 | . .       (doc ids 0 0 0 0 1 1 1 1 -1 -1)

    ``join`` gathers the streams into the joint order, ``split`` returns them; both are one
    index_select, differentiable and compile-friendly. ``stream_ids_J`` says which stream
    each joint token came from (in the order of ``streams``).
    """

    streams: tuple[str, ...]
    padded_lens: tuple[int, ...]  # each stream's padded_len (tokens, padding included)
    src_index_J: torch.Tensor  # joint position -> position in cat(streams)
    dest_index: dict[str, torch.Tensor]  # stream token -> joint position
    stream_ids_J: torch.Tensor
    layout: StreamLayout

    def join(self, xs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``{"latents": (T_v, ...), "action": (T_a, ...)}`` -> ``(T_v + T_a, ...)``."""
        for name, n in zip(self.streams, self.padded_lens, strict=True):
            if name not in xs:
                raise KeyError(f"join needs stream {name!r}; got {sorted(xs)}")
            if xs[name].shape[0] != n:
                raise ValueError(
                    f"stream {name!r} has {xs[name].shape[0]} tokens, the layout expects {n} "
                    f"(token level: patchify grid streams before joining)"
                )
        cat = torch.cat([xs[n] for n in self.streams], dim=0)
        return cat.index_select(0, self.src_index_J)

    def split(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Inverse of `join`."""
        return {n: x.index_select(0, self.dest_index[n]) for n in self.streams}

    def to(self, device: torch.device | str, non_blocking: bool = False) -> JointLayout:
        device = check_device("device", device)
        check_bool("non_blocking", non_blocking)
        return JointLayout(
            streams=self.streams,
            padded_lens=self.padded_lens,
            src_index_J=self.src_index_J.to(device, non_blocking=non_blocking),
            dest_index={
                k: v.to(device, non_blocking=non_blocking) for k, v in self.dest_index.items()
            },
            stream_ids_J=self.stream_ids_J.to(device, non_blocking=non_blocking),
            layout=self.layout.to(device, non_blocking),
        )


def _move(value: Any, method: str, *args: Any, **kwargs: Any) -> Any:
    """Call ``value.<method>(...)`` on tensors and on objects that have it (layouts), recursing
    into dicts; leave everything else (ints, strings) as it is."""
    if isinstance(value, dict):
        return {k: _move(v, method, *args, **kwargs) for k, v in value.items()}
    if isinstance(value, torch.Tensor) or (
        not isinstance(value, type) and callable(getattr(value, method, None))
    ):
        return getattr(value, method)(*args, **kwargs)
    return value


@dataclass
class PackedBatch(Mapping[str, Any]):
    """K episodes concatenated along the sequence axis, with their layouts.

    As a mapping (``batch[key]``):

    - each stream name -> the K episodes' data concatenated, padded at the tail;
    - ``"doc_ids"``, ``"position_ids"``, ``"cu_seqlens"``, ``"max_seqlen"`` -> the primary
      stream's layout (the first stream); ``"thw"`` too when it is a grid stream;
    - ``"episode_index"`` -> int64 (K,);
    - every per-episode value (0-d tensors, numbers, strings) -> stacked per document:
      a (K,) tensor for numbers, a list for strings.

    - every key of ``extras`` (the caller's: ``"seed"``, ``"step"``) not starting with ``_``.

    The four namespaces never overlap: the layout's names (``doc_ids``, ``position_ids``,
    ``cu_seqlens``, ``max_seqlen``, ``thw``) are reserved, and a stream, per-episode value or
    extras key of the same name as another is refused, naming the key (so ``batch["doc_ids"]``
    is always the layout's ids). Lookups read the one dict that holds the key; nothing is
    rebuilt per access. Other streams' layouts:
    ``batch.layout("action")``. ``batch.num_docs`` is K.

    Fields the collator fills besides the data (not in the mapping):

    - ``value_kinds``: how each per-episode value was given (``"int"``, ``"float"``,
      ``"bool"``, ``"str"``, ``"tensor"``; ``"absent"`` for an ``episode_index`` the collator
      made up), so `packing.data._collate.unpack` returns it as it came in;
    - ``host_episode_ids``: the K episodes' ``episode_index`` as host ints, read by
      ``episode_ids`` (``None``: read from ``per_episode`` on the CPU);
    - ``joint_layouts``: the `packing.data._joint.joint_layout` cache, by tuple of stream names.
    """

    streams: dict[str, torch.Tensor]
    layouts: dict[str, StreamLayout]
    per_episode: dict[str, Any]
    primary: str
    extras: dict[str, Any] = field(default_factory=dict)
    value_kinds: dict[str, str] = field(default_factory=dict)
    host_episode_ids: tuple[int, ...] | None = None
    joint_layouts: dict[tuple[str, ...], JointLayout] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_namespaces(self.streams, self.per_episode, self.extras)
        # Every later write to extras is checked too (batch.extras.update(seed=0, step=100)).
        self.extras = Extras(self.extras, self.streams, self.per_episode)

    # -- the primary layout, by name ------------------------------------------------------
    @property
    def doc_ids(self) -> torch.Tensor:
        return self.layouts[self.primary].doc_ids_T

    @property
    def position_ids(self) -> torch.Tensor:
        return self.layouts[self.primary].position_ids_T

    @property
    def cu_seqlens(self) -> torch.Tensor:
        return self.layouts[self.primary].cu_seqlens_K1

    @property
    def max_seqlen(self) -> int:
        return self.layouts[self.primary].max_seqlen

    @property
    def num_docs(self) -> int:
        return self.layouts[self.primary].num_docs

    @property
    def episode_ids(self) -> tuple[int, ...]:
        """The K real documents' ``episode_index`` as host ints, kept on the host by ``to()``
        so per-episode RNG keys never cost a device sync."""
        if self.host_episode_ids is not None:
            return self.host_episode_ids
        index = self.per_episode["episode_index"]
        if index.device.type != "cpu":
            raise RuntimeError(
                "this PackedBatch was not built by PackedCollator and its episode_index is on "
                f"{index.device}; reading it would be a host-device sync"
            )
        return tuple(int(i) for i in index[: self.num_docs].tolist())

    def layout(self, stream: str | None = None) -> StreamLayout:
        """The layout of ``stream`` (the primary stream when None)."""
        name = self.primary if stream is None else stream
        if name not in self.layouts:
            raise KeyError(f"no stream {name!r} in this batch; streams are {list(self.layouts)}")
        return self.layouts[name]

    def token_layout(self, stream: str, rows: int, what: str, fix: str) -> StreamLayout:
        """The layout of ``stream`` for a per-token tensor of ``rows`` rows (a model's output
        or loss), checked: a ValueError names ``what`` and, for an unknown stream, ``fix``."""
        if stream not in self.layouts:
            raise ValueError(
                f"{what} is keyed {stream!r}, which is not a stream of the batch (streams: "
                f"{list(self.layouts)}); {fix}"
            )
        layout = self.layouts[stream]
        if rows != layout.padded_len:
            raise ValueError(
                f"{what} has {rows} rows but stream {stream!r} has {layout.padded_len} tokens; "
                "per-token tensors have one row per token, sequence axis first"
            )
        return layout

    # -- Mapping ----------------------------------------------------------------------------
    # The namespaces are disjoint: checked at construction, and extras (the one namespace the
    # caller writes later) refuses a taken key at every write (`Extras`).
    def _layout_keys(self) -> tuple[str, ...]:
        has_thw = self.layouts[self.primary].thw_T3 is not None
        return _LAYOUT_KEYS if has_thw else _LAYOUT_KEYS[:-1]  # "thw" is last

    def __getitem__(self, key: str) -> Any:
        attr = _LAYOUT_ATTRS.get(key)
        if attr is not None:
            value = getattr(self.layouts[self.primary], attr)
            if value is not None:  # None: "thw" of a stream without a grid
                return value
        elif key in self.streams:
            return self.streams[key]
        elif key in self.per_episode:
            return self.per_episode[key]
        if key in self.extras and not key.startswith("_"):
            return self.extras[key]
        raise KeyError(f"{key!r} is not in this PackedBatch; keys are {list(self)}")

    def __iter__(self) -> Iterator[str]:
        # Insertion order of the old flat dict: streams, layout, per-episode, extras.
        keys = dict.fromkeys(self.streams)
        keys.update(dict.fromkeys(self._layout_keys()))
        keys.update(dict.fromkeys(self.per_episode))
        keys.update(dict.fromkeys(k for k in self.extras if not k.startswith("_")))
        return iter(keys)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    # -- devices ----------------------------------------------------------------------------
    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        """A copy on ``device``; Python ints and lists (lengths, max_seqlen) stay on the host."""
        device = check_device("device", device)
        check_bool("non_blocking", non_blocking)

        kw = {"non_blocking": non_blocking}
        return replace(
            self,
            streams=_move(self.streams, "to", device, **kw),
            layouts=_move(self.layouts, "to", device, **kw),
            per_episode=_move(self.per_episode, "to", device, **kw),
            extras=_move(self.extras, "to", device, **kw),
            joint_layouts=_move(self.joint_layouts, "to", device, **kw),
        )

    def pin_memory(self) -> PackedBatch:
        """Called by ``DataLoader(pin_memory=True)``."""

        return replace(
            self,
            streams=_move(self.streams, "pin_memory"),
            layouts=_move(self.layouts, "pin_memory"),
            per_episode=_move(self.per_episode, "pin_memory"),
            extras=_move(self.extras, "pin_memory"),
            joint_layouts=_move(self.joint_layouts, "pin_memory"),
        )

    def __repr__(self) -> str:
        lay = self.layouts[self.primary]
        streams = ", ".join(f"{k}{tuple(v.shape)}" for k, v in self.streams.items())
        return (
            f"PackedBatch(K={lay.num_docs}, primary={self.primary!r}, streams=[{streams}], "
            f"tokens={lay.num_tokens}/{lay.padded_len} ({lay.efficiency:.1%}))"
        )


class Extras(dict[str, Any]):
    """``PackedBatch.extras``: the caller's own keys (``seed``, ``step``), a dict that refuses
    at every write (``[key] =``, ``update``, ``setdefault``, ``|=``) a key that the layout, a
    stream or a per-episode value already holds, so ``batch[key]`` never reads another
    namespace's value than the one just written."""

    def __init__(
        self, data: Mapping[str, Any], streams: Mapping[str, Any], per_episode: Mapping[str, Any]
    ) -> None:
        super().__init__(data)
        self._taken = (streams, per_episode)

    def _check(self, key: Any) -> None:
        taken = getattr(self, "_taken", None)  # unset while pickle restores the items
        if taken is None or not isinstance(key, str) or key.startswith("_"):
            return
        streams, per_episode = taken
        where = (
            "the layout" if key in _LAYOUT_ATTRS
            else "streams" if key in streams
            else "per-episode values" if key in per_episode
            else None
        )  # fmt: skip
        if where is not None:
            raise ValueError(
                f"batch.extras[{key!r}]: {key!r} is already in {where} of this PackedBatch, and "
                f"batch[{key!r}] would read that one; pick another name for your key (e.g. "
                f"'train_{key}'), or rename the episodes' key"
            )

    def __setitem__(self, key: str, value: Any) -> None:
        self._check(key)
        super().__setitem__(key, value)

    def update(self, *args: Any, **kwargs: Any) -> None:
        new = dict(*args, **kwargs)
        for key in new:
            self._check(key)
        super().update(new)

    def setdefault(self, key: str, default: Any = None) -> Any:
        self._check(key)
        return super().setdefault(key, default)

    def __ior__(self, other: Any) -> Extras:  # type: ignore[override,misc]
        self.update(other)
        return self


# batch[key] -> the primary StreamLayout's attribute; "thw" only for a grid stream.
_LAYOUT_ATTRS = {
    "doc_ids": "doc_ids_T",
    "position_ids": "position_ids_T",
    "cu_seqlens": "cu_seqlens_K1",
    "max_seqlen": "max_seqlen",
    "thw": "thw_T3",
}
_LAYOUT_KEYS = tuple(_LAYOUT_ATTRS)


def _check_namespaces(
    streams: Mapping[str, Any], per_episode: Mapping[str, Any], extras: Mapping[str, Any]
) -> None:
    """A key lives in one namespace only: the layout's reserved names, streams, per-episode
    values, extras (keys starting with ``_`` are private to the library and not checked)."""
    places = {"the layout": set(_LAYOUT_KEYS), "streams": set(streams)}
    places["per-episode values"] = set(per_episode)
    places["extras"] = {k for k in extras if not k.startswith("_")}
    names = list(places)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            both = sorted(places[a] & places[b])
            if both:
                raise ValueError(
                    f"key {both[0]!r} is both in {a} and in {b} of this PackedBatch; rename "
                    f"it in {b if a == 'the layout' else a} (the layout's names "
                    f"{list(_LAYOUT_KEYS)} are reserved; an episode key becomes a per-episode "
                    "value, batch.extras holds the caller's own keys)"
                )


def layout_from_lengths(
    lengths: list[int],
    steps: list[int],
    padded: int,
    tokens_per_step: int = 1,
    grid: tuple[int, int] | None = None,
    max_docs: int | None = None,
) -> StreamLayout:
    """Token-level layout from per-document token counts (host ints -> CPU tensors).

    ``layout_from_lengths([2, 4, 3], [2, 4, 3], padded=12)`` gives doc ids
    ``[0 0 1 1 1 1 2 2 2 -1 -1 -1]`` and ``cu_seqlens [0, 2, 6, 9]``; with ``max_docs=5``
    ``cu_seqlens`` is ``[0, 2, 6, 9, 9, 9]`` (empty documents at the end keep its shape).

    Runs in the collate of every step, so it costs a few numpy calls, not a few per document
    or per token: positions (and ``thw``) come from `packing._layout_math`, K slices of one
    cached template joined by one ``np.concatenate`` (a memcpy); doc ids are one ``np.repeat``.
    """
    if not (
        type(lengths) is list
        and type(steps) is list
        and all(type(x) is int and x > 0 for x in lengths)
        and all(type(x) is int and x > 0 for x in steps)
        and type(padded) is int
        and type(tokens_per_step) is int
        and tokens_per_step > 0
    ):  # the collator's own call passes the fast test; anything else is checked in detail
        lengths, steps = _checked_counts(lengths, steps, padded, tokens_per_step)
    if len(lengths) != len(steps):
        raise ValueError(
            f"lengths has {len(lengths)} documents but steps {len(steps)}; pass one of each "
            "per document"
        )
    if grid is not None:
        grid = check_int_tuple("grid", grid, length=2)  # type: ignore[assignment]
    max_docs = check_optional_int("max_docs", max_docs, min=0)
    total = sum(lengths)
    if total > padded:
        raise ValueError(
            f"{total:,} tokens (lengths {lengths}) do not fit in padded={padded:,}; pass "
            "padded >= the sum of the lengths (the collator pads to the stream's budget)"
        )
    k = len(lengths)
    arrays = layout_arrays(lengths, padded, grid, max(k, max_docs or 0))
    return StreamLayout(
        doc_ids_T=torch.from_numpy(arrays.doc_ids_T),
        position_ids_T=torch.from_numpy(arrays.position_ids_T),
        cu_seqlens_K1=torch.from_numpy(arrays.cu_seqlens_K1),
        max_seqlen=max(lengths, default=0),
        lengths_K=tuple(lengths),
        steps_K=tuple(steps),
        tokens_per_step=tokens_per_step,
        grid=grid,
        thw_T3=None if arrays.thw_T3 is None else torch.from_numpy(arrays.thw_T3),
    )


def _checked_counts(
    lengths: Any, steps: Any, padded: Any, tokens_per_step: Any
) -> tuple[list[int], list[int]]:
    """`layout_from_lengths`' arguments checked: int counts >= 0 (numpy ints too; an episode
    may have no tokens in a stream, e.g. a request generating no actions), never a float or a
    string read as a sequence."""
    check_int("padded", padded, min=0, hint="the stream's padded token count")
    check_int("tokens_per_step", tokens_per_step, min=1)
    ls = [
        check_int(f"lengths[{k}]", x, min=0)
        for k, x in enumerate(check_sequence("lengths", lengths))
    ]
    ss = [check_int(f"steps[{k}]", x, min=0) for k, x in enumerate(check_sequence("steps", steps))]
    return ls, ss
