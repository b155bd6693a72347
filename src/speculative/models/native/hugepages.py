"""Weights and KV caches on transparent huge pages: 2 MiB-aligned arenas, advised before
first touch.

A decode step streams every weight once (about 100 MB for the default int4 model). On
4 KiB pages that stream crosses a page, and often a TLB miss, every 4 KiB; a software
prefetch that misses the TLB may be dropped, so the kernels stall where they meant to
overlap. On 2 MiB pages (Linux transparent huge pages: ``madvise(MADV_HUGEPAGE)``, which
works under the common ``madvise`` setting of
``/sys/kernel/mm/transparent_hugepage/enabled``) the same stream needs 512 times fewer
translations. Placement changes no value: the packed bytes are copied as they are.

The KV cache (:func:`zeros_on_huge_pages`), which attention reads in long runs, is
allocated the same way. ``$SPECULATIVE_HUGE_PAGES=0`` turns the placement off (4 KiB
pages, as torch allocates).
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch

HUGE_PAGE_BYTES = 2 << 20
ENV = "SPECULATIVE_HUGE_PAGES"
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
ALIGN = 64  # each tensor in the arena starts on a cache line


class HasPackedWeight(Protocol):
    weight: torch.Tensor


def huge_pages_wanted() -> bool:
    """Whether to place weights on huge pages: Linux, and not turned off by the env var."""
    return sys.platform.startswith("linux") and os.environ.get(ENV, "1").strip() not in (
        "0", "off", "no", "false",
    )  # fmt: skip


def thp_mode() -> str | None:
    """The kernel's transparent-huge-page mode (``always``, ``madvise`` or ``never``), or
    None where it cannot be read."""
    try:
        text = THP_SETTING.read_text()
    except OSError:
        return None
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


def huge_page_arena(nbytes: int, advise: bool = True) -> tuple[torch.Tensor, int]:
    """(storage [nbytes + 2 MiB] uint8, offset of its first 2 MiB boundary): ``nbytes``
    from ``offset`` on lie on whole huge pages, advised for THP (when ``advise``) before
    anything touches them. The storage is a fresh anonymous mapping, never memory that
    malloc hands back after others used it: pages touched before the advice stay 4 KiB."""
    length = nbytes + HUGE_PAGE_BYTES
    private = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # shared memory would be shmem: no THP
    region = mmap.mmap(-1, length, flags=private)  # the tensor below keeps it alive
    raw = torch.frombuffer(region, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    if advise and hasattr(mmap, "MADV_HUGEPAGE"):
        span = min(-(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES, length - offset)
        # a kernel without THP refuses the advice (EINVAL): the arena stays on 4 KiB pages
        with contextlib.suppress(OSError):
            region.madvise(mmap.MADV_HUGEPAGE, offset, span // mmap.PAGESIZE * mmap.PAGESIZE)
    return raw, offset


def place_on_huge_pages(owners: Sequence[HasPackedWeight]) -> torch.Tensor | None:
    """Copy every owner's ``weight`` into one huge-page arena and point the owner at its
    copy (a view of the arena, which keeps it alive); returns the arena, or None when
    placement is off (:func:`huge_pages_wanted`) or nothing is large enough to gain."""
    sizes = [o.weight.numel() * o.weight.element_size() for o in owners]
    slots = [-(-n // ALIGN) * ALIGN for n in sizes]  # each size rounded up to a cache line
    if not huge_pages_wanted() or sum(slots) < HUGE_PAGE_BYTES:
        return None
    raw, at = huge_page_arena(sum(slots))
    for owner, size, slot in zip(owners, sizes, slots, strict=True):
        weight = owner.weight.contiguous()
        view = raw[at : at + size].view(weight.dtype).view(weight.shape)
        view.copy_(weight)
        owner.weight = view
        at += slot
    return raw


def zeros_on_huge_pages(shape: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``torch.zeros(shape, dtype)`` on huge pages where placement is on and the tensor
    fills at least one (a KV cache, read in long runs by attention); else torch.zeros."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not huge_pages_wanted() or nbytes < HUGE_PAGE_BYTES:
        return torch.zeros(*shape, dtype=dtype)
    raw, at = huge_page_arena(nbytes)
    # a fresh anonymous mapping reads as zeros (the kernel zeroes each page when it is
    # first touched): zeroing it here would fault in and write every page up front
    return raw[at : at + nbytes].view(dtype).view(*shape)


def huge_page_bytes(address: int) -> int | None:
    """Bytes of the mapping holding ``address`` that sit on transparent huge pages
    (``AnonHugePages`` of /proc/self/smaps), or None where that cannot be read."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return None
