"""Host memory for the CPU tier's expert stacks, on transparent huge pages.

A decode step's CPU experts are a few rows picked from gigabytes of stacks. On 4 KiB pages every
32 KiB row of a Qwen3-30B-A3B expert spans eight pages, and each page costs the reading core a
TLB miss and a page walk before the prefetchers can stream it. On 2 MiB pages a whole expert
sits in a few. On the test host one thread of the fused kernel computed a token's eight experts
2-13% faster from huge pages (BENCHMARKS.md, 2026-12-05 (late); two threads: within that VM's spread).

Linux gives huge pages to anonymous memory that asks for them (``MADV_HUGEPAGE``) when
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` (most distributions) or
``always``; the advice has to come before the pages are first touched, so the stacks are mapped
here, advised, then filled by the loader. ``WORKBENCH_HUGE_PAGES=0`` keeps torch's own allocator.
Page-locking the stacks for the bus (``bus.register``) works the same on either.
"""

from __future__ import annotations

import math
import mmap
import os
import weakref

import torch

HUGE_PAGE = 2 * 2**20
"""Bytes of a transparent huge page on x86-64 and most arm64 kernels."""


def enabled() -> bool:
    """Whether stacks of at least ``HUGE_PAGE`` bytes are mapped on huge pages (Linux with THP, and
    ``WORKBENCH_HUGE_PAGES`` not ``0``)."""
    return os.environ.get("WORKBENCH_HUGE_PAGES", "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE")


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor ``shape`` of ``dtype``. From ``HUGE_PAGE`` bytes up (and when
    ``enabled``) its memory is an anonymous mapping aligned to ``HUGE_PAGE`` and advised
    ``MADV_HUGEPAGE`` before first touch (zero-filled, as any fresh mapping; plain pages where the
    kernel refuses the advice); the tensor keeps the mapping alive and unmaps it when freed. Smaller
    tensors come from torch's allocator."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE or not enabled():
        return torch.empty(shape, dtype=dtype)
    m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)  # private: shared memory gets no THP; slack to align
    start = _address(m)
    offset = -start % HUGE_PAGE
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP off in this kernel ("never") or unsupported: plain pages, still correct
        pass
    flat = torch.frombuffer(m, dtype=torch.uint8, count=nbytes, offset=offset)
    _live.add(start + offset)
    weakref.finalize(m, _live.discard, start + offset)  # the mapping goes with the last tensor on it
    return flat.view(dtype).view(shape)


_live: set[int] = set()


def owns(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage is one of ``empty``'s mappings (not torch's allocator). Other memory
    may carry the huge-page advice too: NumPy advises its large buffers, and the C library reuses
    them for later allocations."""
    return t.untyped_storage().data_ptr() in _live


def _address(m: mmap.mmap) -> int:
    """The virtual address where mapping ``m`` starts."""
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(m))


def huge_bytes(t: torch.Tensor) -> int:
    """Bytes of the mapping holding ``t`` that the kernel backs with huge pages now
    (``AnonHugePages`` of its ``/proc/self/smaps`` entry); 0 where that file is missing."""
    return huge_bytes_each([t])[0]


def huge_bytes_each(tensors: list[torch.Tensor]) -> list[int]:
    """``huge_bytes`` of each of ``tensors``, from one read of ``/proc/self/smaps`` (a process with a
    CUDA context has thousands of mappings: one read per tensor would read them all each time)."""
    entries = _smaps_entries([t.data_ptr() for t in tensors])
    out = []
    for entry in entries:
        huge = [int(line.split()[1]) * 1024 for line in entry if line.startswith("AnonHugePages:")]
        out.append(huge[0] if huge else 0)
    return out


def node_bytes_each(tensors: list[torch.Tensor]) -> list[dict[int, int]]:
    """Bytes of the mapping holding each of ``tensors`` that sit on each NUMA node now, ``{node: bytes}``
    (pages the kernel has placed: ``/proc/self/numa_maps``, by the mapping's start in
    ``/proc/self/smaps``); ``{}`` where those files are missing. A CPU tier on a node away from its
    threads' cores reads at the link between the sockets, not the RAM's rate."""
    starts = []
    for entry in _smaps_entries([t.data_ptr() for t in tensors]):
        head = entry[0].split(" ", 1)[0] if entry else ""
        starts.append(int(head.split("-")[0], 16) if "-" in head else None)
    try:
        with open("/proc/self/numa_maps") as f:
            nodes = parse_numa_maps(f.read())
    except OSError:
        return [{} for _ in tensors]
    return [dict(nodes.get(a, {})) if a is not None else {} for a in starts]


def parse_numa_maps(text: str) -> dict[int, dict[int, int]]:
    """``/proc/<pid>/numa_maps`` as ``{mapping start address: {node: bytes}}`` (``N<node>=<pages>``
    times the line's ``kernelpagesize_kB``)."""
    out: dict[int, dict[int, int]] = {}
    for line in text.splitlines():
        fields = line.split()
        if not fields:
            continue
        try:
            start = int(fields[0], 16)
        except ValueError:
            continue
        page = next((int(f.split("=", 1)[1]) * 1024 for f in fields if f.startswith("kernelpagesize_kB=")), 4096)
        nodes = {}
        for f in fields[1:]:
            if f.startswith("N") and "=" in f and f[1:f.index("=")].isdigit():
                nodes[int(f[1:f.index("=")])] = int(f.split("=", 1)[1]) * page
        out[start] = nodes
    return out


def advised(t: torch.Tensor) -> bool:
    """Whether the mapping holding ``t`` carries the huge-page advice (``hg`` in its ``VmFlags``)."""
    return any(line.startswith("VmFlags:") and " hg" in line for line in _smaps_entry(t.data_ptr()))


def _smaps_entry(address: int) -> list[str]:
    return _smaps_entries([address])[0]


def _smaps_entries(addresses: list[int]) -> list[list[str]]:
    """The ``/proc/self/smaps`` lines of the mapping holding each address (empty: none, or no file)."""
    try:
        with open("/proc/self/smaps") as f:
            lines = f.read().splitlines()
    except OSError:
        return [[] for _ in addresses]
    out: list[list[str]] = [[] for _ in addresses]
    inside: list[int] = []  # the addresses the current mapping holds
    for line in lines:
        head = line.split(" ", 1)[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = [i for i, a in enumerate(addresses) if lo <= a < hi]
        for i in inside:
            out[i].append(line)
    return out
