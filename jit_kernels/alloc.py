"""Allocations a replayed launch makes per call, with as little host time as torch allows.

A replayed call allocates what the full path allocated: an op's outputs left as None, a
kernel's scratch. Each is a torch op (argument parsing, dispatch, a tensor to build and
later free), a large share of a cached call's host time (BENCHMARKS.md, "Host time per
cached call"). Two cheaper forms, each giving exactly what the full path would have:

- ``output_maker``: ``torch.empty_like`` of a one-element tensor expanded to the output's
  shape: one positional argument to parse instead of a size, a dtype and a device
  (~0.3 us less per output, CPU). The result has torch.empty's contiguous strides once
  the output has two elements; a smaller one is torch.empty's own.
- ``Scratch``: device memory taken from torch's CUDA caching allocator and handed back,
  as raw addresses, right after the launches that use it are enqueued. These are the
  allocator calls a ``torch.empty`` tensor dropped after those launches makes (its
  storage's deleter is the same ``raw_delete``), on the same stream, so stream order,
  CUDA-graph capture (the capture's private pool) and memory statistics are unchanged;
  only the tensor, its dispatch and its Python object are not made.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from typing import NamedTuple

import torch

UNCACHED_ENV = "PYTORCH_NO_CUDA_MEMORY_CACHING"


class RawAllocator(NamedTuple):
    """Raw device memory: ``alloc(nbytes, stream) -> address`` on the current device,
    ``delete(address)``, and ``current_device() -> index``."""

    alloc: Callable[[int, int], int]
    delete: Callable[[int], None]
    current_device: Callable[[], int]


def output_maker(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Callable:
    """A call returning a new ``torch.empty(shape, dtype=dtype, device=device)``."""
    # empty_like keeps the strides of a dense input. The expanded proto is not dense once
    # it has two elements (a dim of size > 1 with stride 0), so the result takes
    # contiguous strides; with fewer it is, and its strides (zeros) are not torch.empty's.
    if math.prod(shape) < 2:
        return functools.partial(torch.empty, shape, dtype=dtype, device=device)
    proto = torch.empty((), dtype=dtype, device=device).expand(shape)
    return functools.partial(torch.empty_like, proto)  # a partial: no Python frame per call


def raw_allocator(device: torch.device) -> RawAllocator | None:
    """torch's CUDA caching allocator, raw, where its allocations behave as ``device``'s
    tensor allocations would: a CUDA device, the allocator on and caching (a process that
    turns caching off, e.g. for compute-sanitizer, gets torch.empty buffers, cudaMalloc'd
    as its tensors are). Its private bindings are what torch.cuda.caching_allocator_alloc
    calls after a device switch and checks that cost more than the allocation."""
    calls = [
        getattr(torch._C, name, None)
        for name in (
            "_cuda_cudaCachingAllocator_raw_alloc",
            "_cuda_cudaCachingAllocator_raw_delete",
            "_cuda_getDevice",
        )
    ]
    if device.type != "cuda" or None in calls or os.environ.get(UNCACHED_ENV) == "1":
        return None
    enabled = getattr(torch._C, "_cuda_cudaCachingAllocator_is_enabled", None)
    return RawAllocator(*calls) if enabled is None or enabled() else None


class Scratch:
    """``nbytes`` of device memory per call on ``device`` (``index``: its CUDA index):

        address, held = scratch.take(stream)
        try:
            ...launch the kernels that use it on ``stream``...
        finally:
            scratch.give(address, held)

    From ``raw`` (``raw_allocator(device)``) where it serves and ``device`` is the current
    device (the raw allocator allocates on the current one); else a torch.empty buffer
    kept alive (``held``) until ``give``."""

    __slots__ = ("nbytes", "device", "index", "alloc", "delete", "current")

    def __init__(self, nbytes: int, device: torch.device, index: int, raw: RawAllocator | None):
        self.nbytes, self.device, self.index = nbytes, device, index
        # The calls themselves in slots: a replay reads them without a tuple lookup.
        self.alloc, self.delete, self.current = raw if raw is not None else (None, None, None)

    def take(self, stream: int) -> tuple[int, torch.Tensor | None]:
        """(address, the buffer to keep until ``give``: None for a raw allocation)."""
        if self.alloc is not None and self.current() == self.index:
            return self.alloc(self.nbytes, stream), None  # 0 bytes: address 0, as torch's
        held = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        return held.data_ptr(), held

    def give(self, address: int, held: torch.Tensor | None) -> None:
        """Hand ``take``'s memory back (the launches using it are enqueued: the allocator
        reuses it in stream order, as it would a dropped tensor's)."""
        if held is None and address:
            self.delete(address)
