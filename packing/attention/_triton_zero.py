"""A Triton kernel that zeroes the rows of a CUDA tensor from a device-side row index on.

Used by `packing.attention._fa4` to make the padding rows of an attention output read 0 without a pass
over the whole output (``torch.where`` reads and writes all of it: 0.2 ms of a 2.1 ms
cross-attention call on the H200) and without a host-device sync (the start row is a device
tensor). Programs that lie wholly before the start row store nothing.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

__all__ = ["zero_rows_from_cuda"]

_BLOCK = 4096


@triton.jit
def _zero_from_kernel(x_ptr, start_ptr, row_elems, total, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    pid = tl.program_id(0).to(tl.int64)
    first = tl.load(start_ptr).to(tl.int64) * row_elems
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    if pid * BLOCK + BLOCK > first:
        zero = tl.zeros([BLOCK], dtype=x_ptr.dtype.element_ty)
        tl.store(x_ptr + offs, zero, mask=(offs >= first) & (offs < total))


def zero_rows_from_cuda(x: Tensor, start_1: Tensor) -> None:
    """``x[start_1[0]:] = 0`` in place; ``x`` contiguous on CUDA, ``start_1`` int (1,)."""
    assert x.is_contiguous() and x.is_cuda and start_1.is_cuda
    total = x.numel()
    if total == 0:
        return
    row_elems = total // max(x.shape[0], 1)
    grid = (triton.cdiv(total, _BLOCK),)
    _zero_from_kernel[grid](x, start_1, row_elems, total, BLOCK=_BLOCK)
