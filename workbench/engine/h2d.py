"""Host-to-GPU copies queued through the CUDA driver in one call each.

A prompt's fetched expert costs the host one ``Tensor.copy_`` per weight tensor (two views, the
dispatcher, the runtime call: ~20 µs each, ~100 µs for a Q8_0 expert's four tensors), which on a
hybrid prompt layer added up to more host time than its copies took on the bus. ``Copier`` queues
the same copies with the driver's ``cuMemcpyHtoDAsync`` from raw addresses (a few µs each), on the
stream it is given, in the order given: the bus's stream events and the caching allocator see the
same stream work as before.

It is used only where it can be: Linux's ``libcuda.so.1`` present, a CUDA context current on the
calling thread (the engine's thread, which has run CUDA work through torch), and both sides of a
copy whole rows of contiguous tensors. ``WORKBENCH_NATIVE_COPIES=0`` turns it off (the torch copies
then run, for measuring one against the other).
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch


@functools.lru_cache(maxsize=1)
def _driver():
    """The CUDA driver's two entry points, or None where there is no driver library."""
    if os.environ.get("WORKBENCH_NATIVE_COPIES", "").strip() == "0":
        return None
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        copy = lib.cuMemcpyHtoDAsync_v2
        current = lib.cuCtxGetCurrent
    except (OSError, AttributeError):
        return None
    copy.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    copy.restype = ctypes.c_int
    current.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    current.restype = ctypes.c_int
    return copy, current


def available() -> bool:
    """Whether copies can go through the driver on this thread now (a context current here)."""
    drv = _driver()
    if drv is None:
        return False
    ctx = ctypes.c_void_p()
    return drv[1](ctypes.byref(ctx)) == 0 and bool(ctx.value)


def rows_of(t: torch.Tensor) -> tuple[int, int] | None:
    """``(address, bytes per row along dim 0)`` of a contiguous tensor, or None for other layouts."""
    if not t.is_contiguous() or t.dim() == 0:
        return None
    return t.data_ptr(), t.stride(0) * t.element_size() if t.dim() > 1 else t.element_size()


class Copier:
    """Queues row copies from host stacks into device stacks on one CUDA stream (see the module)."""

    def __init__(self, stream: torch.cuda.Stream):
        self._copy = _driver()[0]
        self._stream = ctypes.c_void_p(stream.cuda_stream)

    def rows(self, dst: tuple[int, int], dst_row: int, src: tuple[int, int], src_row: int, n: int) -> None:
        """Copy rows ``src_row .. src_row + n`` of the host stack ``src`` into rows ``dst_row ..`` of the
        device stack ``dst`` (both ``rows_of`` pairs of the same row size). RuntimeError with the
        driver's code if it refuses."""
        self.many([dst[0] + dst_row * dst[1]], [src[0] + src_row * dst[1]], [n * dst[1]])

    def many(self, dst: list[int], src: list[int], nbytes: list[int]) -> None:
        """Queue copies of ``nbytes[i]`` bytes from host address ``src[i]`` to device address ``dst[i]``,
        in order (a prompt batch's rows of every tensor: addresses worked out together by the caller,
        one driver call each and nothing else per copy). RuntimeError with the driver's code if it
        refuses one; those before it stay queued."""
        copy, stream = self._copy, self._stream
        for d, s, n in zip(dst, src, nbytes):
            err = copy(d, s, n, stream)
            if err:
                raise RuntimeError(f"CUDA driver error {err} queueing a host-to-GPU copy of {n} bytes")
