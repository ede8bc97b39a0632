"""The one rule for arguments at the public boundary: checked, never coerced.

Every public constructor and function of packing checks its arguments with these helpers, so
the same mistake gets the same message everywhere::

    check_int("token_budget", 128.0, min=1)   TypeError: token_budget=128.0 must be an int ...
    check_int("token_budget", np.int64(128))  -> 128 (numpy ints are ints)
    check_bool("replan", "no")                TypeError: replan='no' must be True or False
    check_sequence("keys", "obs")             TypeError: keys='obs' is a string; pass a list ...

Nothing here calls ``int()``/``bool()``/``float()`` on a value that is not already of that kind
(a numpy int becomes the Python int of the same value; 2.5 is never 2, "no" is never True).
The module sits below every folder (it imports only numpy; torch when a tensor is checked), so
any of them may use it, and so may the torch-free ``packing budget``.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = [
    "check_bool",
    "check_choice",
    "check_doc_ids",
    "check_dtype",
    "check_finite",
    "check_int",
    "check_int_tuple",
    "check_optional_int",
    "check_path",
    "check_real",
    "check_sequence",
    "is_int",
]

T = TypeVar("T")


def is_int(value: Any) -> bool:
    """An int or a numpy integer, not a bool."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def check_int(
    name: str, value: Any, *, min: int | None = None, max: int | None = None, hint: str = ""
) -> int:
    """``value`` as a Python int, or a TypeError/ValueError naming ``name``, the limit and the fix.

    ``int`` and numpy integers pass; ``bool``, floats (even ``128.0``), strings and None do not.
    """
    fix = f" ({hint})" if hint else ""
    if not is_int(value):
        raise TypeError(
            f"{name}={value!r} must be an int, got {type(value).__name__}{fix}; pass an int "
            "(packing never rounds or truncates a size)"
        )
    out = value.item() if isinstance(value, np.integer) else value
    if min is not None and out < min:
        raise ValueError(f"{name}={out} must be >= {min}{fix}")
    if max is not None and out > max:
        raise ValueError(f"{name}={out} must be <= {max}{fix}")
    return int(out)  # already an int: this only drops a subclass


def check_optional_int(
    name: str, value: Any, *, min: int | None = None, max: int | None = None, hint: str = ""
) -> int | None:
    """`check_int`, with None allowed (an unset option)."""
    return None if value is None else check_int(name, value, min=min, max=max, hint=hint)


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a bool (numpy bools too); ``"no"``, ``0`` or ``None`` are refused."""
    if not isinstance(value, bool | np.bool_):
        raise TypeError(
            f"{name}={value!r} must be True or False, got {type(value).__name__}; pass a bool "
            "(a string such as 'no' would be truthy)"
        )
    return value.item() if isinstance(value, np.bool_) else value  # a Python bool either way


def check_path(name: str, value: Any) -> str | os.PathLike[str]:
    """``value`` if it is a path (a ``str`` or ``os.PathLike``), not an int or None."""
    if not isinstance(value, str | os.PathLike):
        raise TypeError(f"{name}={value!r} must be a path (str or pathlib.Path)")
    return value


def check_real(
    name: str,
    value: Any,
    *,
    min: float | None = None,
    above: float | None = None,
    hint: str = "",
) -> float:
    """A finite real number (int or float, numpy scalars too; not bool, not a tensor)."""
    fix = f" ({hint})" if hint else ""
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}={value!r} must be a real number, got {type(value).__name__}{fix}")
    number: float = value.item() if isinstance(value, np.generic) else value  # type: ignore[assignment]
    if not math.isfinite(number):
        raise ValueError(f"{name}={value!r} must be finite{fix}")
    if min is not None and number < min:
        raise ValueError(f"{name}={value!r} must be >= {min}{fix}")
    if above is not None and not number > above:
        raise ValueError(f"{name}={value!r} must be > {above}{fix}")
    return number


def check_choice(name: str, value: Any, choices: Iterable[T]) -> T:
    """``value`` if it is one of ``choices`` (compared by equality, strings only match strings)."""
    options = tuple(choices)
    for c in options:
        if type(value) is type(c) and value == c:
            return c
    raise ValueError(f"{name}={value!r}; choose one of {', '.join(map(repr, options))}")


def check_sequence(
    name: str, value: Any, *, of: type | tuple[type, ...] | None = None
) -> list[Any]:
    """``value`` as a list; a string (iterated character by character), bytes, a dict, a set
    (no order) or a non-iterable is refused, and each item must be an ``of`` when given."""
    if isinstance(value, str | bytes):
        raise TypeError(
            f"{name}={value!r} is a string, not a sequence; pass a list, e.g. {name}=[{value!r}]"
        )
    if isinstance(value, Mapping | set | frozenset) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be a list or tuple, got {type(value).__name__}; pass a list")
    items = list(value)
    if of is not None:
        for i, item in enumerate(items):
            if not isinstance(item, of):
                want = of.__name__ if isinstance(of, type) else " or ".join(t.__name__ for t in of)
                raise TypeError(f"{name}[{i}]={item!r} must be a {want}, got {type(item).__name__}")
    return items


def check_int_tuple(
    name: str, value: Any, *, length: int | None = None, min: int = 1
) -> tuple[int, ...]:
    """A tuple of ints (numpy ints too) each >= ``min``: ``grid=(2.0, 2)`` is refused."""
    items = check_sequence(name, value)
    if length is not None and len(items) != length:
        raise ValueError(f"{name}={value!r} must hold {length} ints, got {len(items)}")
    return tuple(check_int(f"{name}[{i}]", v, min=min) for i, v in enumerate(items))


def check_dtype(name: str, value: Any, *, optional: bool = False) -> torch.dtype | None:
    """A floating ``torch.dtype`` (None too when ``optional``): ``'bf16'`` or ``'bfloat16'``
    is refused, naming the accepted values, before torch reads it as a device string."""
    import torch

    if value is None and optional:
        return None
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        accepted = "torch.bfloat16, torch.float16 or torch.float32" + (
            " or None" if optional else ""
        )
        raise TypeError(f"{name}={value!r} must be a floating torch.dtype; pass {accepted}")
    return value


def check_device(name: str, value: Any) -> torch.device:
    """A ``torch.device``, or a string torch reads as one (``"cpu"``, ``"cuda"``, ``"cuda:1"``);
    an int is refused (torch would read ``3`` as ``cuda:3``)."""
    import torch

    if isinstance(value, torch.device):
        return value
    if isinstance(value, str):
        try:
            return torch.device(value)
        except RuntimeError:
            raise ValueError(
                f"{name}={value!r} is not a device; pass 'cpu', 'cuda' or 'cuda:N'"
            ) from None
    raise TypeError(
        f"{name} must be a torch.device or a device string such as 'cuda', "
        f"got {type(value).__name__}"
    )


def check_doc_ids(name: str, value: Any) -> torch.Tensor:
    """An integer tensor of document ids, kept in its own dtype (never narrowed: ids 0 and
    2**32 stay two documents). Floats and bools are refused; values are checked by the caller."""
    import torch

    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor of document ids, got {type(value).__name__}"
        )
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise TypeError(
            f"{name} must be an integer tensor (int32 or int64) of document ids, got "
            f"{value.dtype}; use batch['doc_ids'] from PackedCollator"
        )
    return value


def check_finite(
    where: str,
    key: str,
    value: torch.Tensor,
    *,
    fix: str = "fix or drop this episode's data (a NaN or inf would make the loss NaN, not the "
    "model)",
) -> None:
    """Raise a ValueError naming ``where`` (an episode, a request), ``key``, the first
    non-finite entry and ``fix``.

    Integer tensors are always finite; floats are checked with one reduction."""
    import torch

    if not (value.dtype.is_floating_point or value.dtype.is_complex):
        return
    bad = ~torch.isfinite(value)
    if bool(bad.any()):
        flat = int(bad.reshape(-1).nonzero()[0])
        index = tuple(int(i) for i in np.unravel_index(flat, tuple(value.shape)))
        raise ValueError(
            f"{where} {key!r} holds {value.reshape(-1)[flat].item()} at index {index} (first of "
            f"{int(bad.sum())} non-finite values); {fix}"
        )
