"""What a CUDA graph's replay depends on, checked on the CPU: `record` one served step's ATen
ops, `host_syncs` in it, `replay_mismatch` between two steps of the same key.

A captured step replays the kernels it recorded, on the addresses it recorded. So a step is
replayable when (1) none of its ops needs the host: no device value read back (``.item()``,
``int(t)``, ``bool(t)``: ``aten._local_scalar_dense``), no output whose shape depends on the
values (``nonzero``, ``masked_select``, ``unique``, a boolean-mask index, ``repeat_interleave``
without ``output_size``), no tensor made from host data inside the step (``torch.tensor``:
``aten.lift_fresh``); and (2) every later step of the same key runs the same ops, with the
same Python arguments, reading every tensor it did not create itself at the same address::

    step at composition A:   mm(x_v @ 0x7f10, W @ 0x5a00) ... index(doc_J @ 0x7f88)
    admission: B copied in   (copy_ into doc_J: same address)       -> replayable
    step at composition B:   mm(x_v @ 0x7f10, W @ 0x5a00) ... index(doc_J @ 0x7f88)
                             a buffer replaced instead (doc_J @ 0x9c40): the graph reads A's

Used by tests/test_serve_capture.py on every `Packs`, and by tests/test_gpu.py.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.attention.flex_attention as _flex
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["Op", "Recorder", "host_syncs", "record", "recording", "replay_mismatch"]

# ops whose output shape or value needs the host to see a device value (beyond the tags)
_ALWAYS = {
    "aten::_local_scalar_dense": "reads a device value on the host (.item(), int(t), bool(t))",
    "aten::item": "reads a device value on the host (.item())",
    "aten::equal": "torch.equal returns a Python bool (a host read)",
    "aten::is_nonzero": "bool(t) reads a device value on the host",
    "aten::nonzero": "its output shape depends on the values",
    "aten::masked_select": "its output shape depends on the values",
    "aten::_unique": "its output shape depends on the values",
    "aten::_unique2": "its output shape depends on the values",
    "aten::unique_dim": "its output shape depends on the values",
    "aten::unique_consecutive": "its output shape depends on the values",
    "aten::unique_dim_consecutive": "its output shape depends on the values",
    "aten::bincount": "its output shape depends on the values",
    "aten::lift_fresh": "a tensor made from host data inside the step (torch.tensor(...))",
    "aten::lift_fresh_copy": "a tensor made from host data inside the step (torch.tensor(...))",
}


# Host reads a step makes on the CPU only: validations of host doc ids, each guarded by
# ``device.type == "cpu"``, so a CUDA step never runs them (test_serve_capture checks the
# guards on the meta device, where a host read raises). Their ops are left out of the checks.
CPU_ONLY = {
    ("_layout_math.py", "check_doc_runs"),  # via packing.attention._masks._check_pair
    ("_conditioning.py", "broadcast_to_tokens"),  # its int(ids.max()) + 1 rows check
}


@dataclass(frozen=True)
class Op:
    """One ATen call: its name, its Python (non-tensor) arguments, and the tensors it read
    that the step did not create: (argument position, address, shape, stride, dtype)."""

    name: str
    scalars: tuple[tuple[int, str], ...]
    external: tuple[tuple[int, int, tuple[int, ...], tuple[int, ...], str], ...]
    problem: str | None = None
    cpu_only: bool = False  # inside a host check that a CUDA step skips (`CPU_ONLY`)

    def __str__(self) -> str:
        ext = ", ".join(f"arg {i} @ {hex(p)} {list(s)}" for i, p, s, _, _ in self.external)
        return f"{self.name}({ext}; {dict(self.scalars)})"


@dataclass
class Recorder(TorchDispatchMode):
    """Records every ATen op run under it (a `TorchDispatchMode`)."""

    ops: list[Op] = field(default_factory=list)
    created: set[int] = field(default_factory=set)  # storages a recorded op returned
    outside: set[int] = field(default_factory=set)  # storages it read but did not create

    supports_higher_order_operators = True  # flex_attention: recorded as one op

    def __post_init__(self) -> None:
        super().__init__()

    # Eager flex_attention compiles a wrapper of its op with dynamo (backend "eager"); traced
    # under this mode, that compile is cached and later eager calls outside it fail to
    # recompile. Recorded, flex calls its op directly (the same math), as its debug flag says.
    def __enter__(self) -> Recorder:
        self._flex_debug = _flex.__dict__["_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG"]
        _flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        _flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = self._flex_debug

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        flat = [t for a in tree_flatten((args, kwargs))[0] for t in _with_closure(a)]
        scalars, external = [], []
        for i, a in enumerate(flat):
            if not isinstance(a, Tensor):
                scalars.append((i, _show(a)))
                continue
            base = _storage(a)
            if base == 0:  # no elements: nothing is read
                continue
            if base not in self.created:
                self.outside.add(base)
                external.append((i, a.data_ptr(), tuple(a.shape), tuple(a.stride()), str(a.dtype)))
        frames = _frames()
        problem = _problem(func, args, kwargs)
        if problem is not None:
            problem += f" (at {_where(frames)})"
        on_cpu = all(t.device.type == "cpu" for t in flat if isinstance(t, Tensor))
        self.ops.append(Op(_name(func), tuple(scalars), tuple(external), problem,
                           on_cpu and _cpu_only(frames)))  # fmt: skip
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor) and _storage(t) not in self.outside:
                self.created.add(_storage(t))
        return out


def _name(func: Any) -> str:
    schema = getattr(func, "_schema", None)
    return f"{schema.name}.{func._overloadname}" if schema is not None else str(func.name())


def _with_closure(a: Any) -> list[Any]:
    """``a``, and for a function (a mask rule given to flex_attention) the tensors it closes
    over: the kernel reads them (eager flex does not pass them as arguments)."""
    if not callable(a) or isinstance(a, Tensor):
        return [a]
    out: list[Any] = [getattr(a, "__qualname__", type(a).__name__)]  # not its address
    for cell in getattr(a, "__closure__", None) or ():
        try:
            v = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        out += [v] if isinstance(v, Tensor) else _with_closure(v) if callable(v) else []
    return out


def _storage(t: Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without storage (meta, functorch)
        return id(t)


def _frames() -> list[Any]:
    f, out = sys._getframe(2), []
    while f is not None:
        if "replay_check" not in f.f_code.co_filename and "torch/utils/_python_dispatch" not in \
                f.f_code.co_filename:  # fmt: skip
            out.append(f)
        f = f.f_back
    return out


def _where(frames: list[Any]) -> str:
    """The innermost lines of packing (else of any Python) that ran the op."""
    ours = [f for f in frames if "/packing/" in f.f_code.co_filename] or frames
    return " <- ".join(f"{Path(f.f_code.co_filename).name}:{f.f_lineno} {f.f_code.co_name}"
                       for f in ours[:3])  # fmt: skip


def _cpu_only(frames: list[Any]) -> bool:
    return any((Path(f.f_code.co_filename).name, f.f_code.co_name) in CPU_ONLY for f in frames)


def _show(a: Any) -> str:
    """A Python argument as the graph would bake it in (floats exactly)."""
    return float.hex(a) if isinstance(a, float) else repr(a)


def _problem(func: Any, args: Any, kwargs: Any) -> str | None:
    if getattr(func, "_schema", None) is None:  # a higher-order op (flex_attention)
        return None
    name = str(func._schema.name)
    if name in _ALWAYS:
        return _ALWAYS[name]
    if name in ("aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"):
        idx = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(t, Tensor) and t.dtype in (torch.bool, torch.uint8) for t in idx):
            return "a boolean-mask index: its shape depends on the values (nonzero inside)"
    tensor_repeats = name == "aten::repeat_interleave" and func._overloadname == "Tensor"
    if tensor_repeats and kwargs.get("output_size") is None:
        return "repeat_interleave with tensor repeats and no output_size reads them on the host"
    if name in ("aten::_to_copy", "aten::copy_"):
        ts = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, Tensor)]
        dev = kwargs.get("device")
        devices = {t.device.type for t in ts} | ({torch.device(dev).type} if dev else set())
        if len(devices) > 1:
            return f"a copy between {sorted(devices)} inside the step"
    return None


def host_syncs(ops: list[Op]) -> list[str]:
    """Each op that needs the host, with why."""
    return [f"{op.name}: {op.problem}" for op in ops if op.problem and not op.cpu_only]


def replay_mismatch(first: list[Op], later: list[Op]) -> str | None:
    """Why a graph captured at ``first`` would not replay ``later`` (None: it would)."""
    first, later = [o for o in first if not o.cpu_only], [o for o in later if not o.cpu_only]
    for i, (a, b) in enumerate(zip(first, later, strict=False)):
        if a.name != b.name:
            return f"op {i}: {a.name} then {b.name} (the step runs other ops)"
        if a.scalars != b.scalars:
            return f"op {i} {a.name}: Python arguments {dict(a.scalars)} then {dict(b.scalars)}"
        if a.external != b.external:
            return (f"op {i} {a.name} reads a tensor from outside the step at another address "
                    f"or shape: {a} then {b}")  # fmt: skip
    if len(first) != len(later):
        return f"{len(first)} ops then {len(later)}"
    return None


def record(fn: Callable[[], Any]) -> list[Op]:
    """The ops ``fn()`` runs."""
    rec = Recorder()
    with rec:
        fn()
    return rec.ops


@contextmanager
def recording(obj: Any, name: str, key: Callable[..., Any]) -> Iterator[list[tuple[Any, Any]]]:
    """Within: every call of ``obj.name(*args)`` is recorded, as ``(key(*args), ops)``."""
    calls: list[tuple[Any, Any]] = []
    inner, own = getattr(obj, name), vars(obj).get(name)

    def wrapped(*args: Any, **kw: Any) -> Any:
        rec = Recorder()
        with rec:
            out = inner(*args, **kw)
        calls.append((key(*args), rec.ops))
        return out

    setattr(obj, name, wrapped)
    try:
        yield calls
    finally:
        if own is None:
            delattr(obj, name)  # the class's method again
        else:
            setattr(obj, name, own)
