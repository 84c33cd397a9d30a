"""jit_kernels.alloc without a GPU: a replay's outputs are what torch.empty makes, and its
scratch goes back to the allocator it came from, once, whatever the launches did."""

from __future__ import annotations

import itertools

import pytest
import torch

import jit_kernels.alloc as alloc
from jit_kernels.alloc import RawAllocator, Scratch, output_maker, raw_allocator

CPU = torch.device("cpu")
SHAPES = [(), (1,), (1, 1), (2, 0, 3), (4, 1), (1, 8256), (1, 16, 192), (3, 2, 128), (5, 1, 7)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn, torch.bfloat16])
def test_outputs_are_torch_empty_s(shape, dtype):
    make = output_maker(shape, dtype, CPU)
    want = torch.empty(shape, dtype=dtype, device=CPU)
    first, second = make(), make()
    for got in (first, second):
        assert (got.shape, got.stride(), got.dtype, got.device) == (
            want.shape,
            want.stride(),
            want.dtype,
            want.device,
        )
        assert not got.requires_grad and got._base is None
    if first.numel():  # a new allocation each call, never a view of a shared one
        assert first.data_ptr() != second.data_ptr()


def test_output_strides_are_torch_empty_s_for_every_small_shape():
    """The rule output_maker relies on (an expanded proto of two or more elements is not
    dense, so empty_like gives contiguous strides), over every shape of up to 4 dims."""
    for shape in itertools.chain.from_iterable(
        itertools.product([0, 1, 2, 3, 5], repeat=dims) for dims in range(5)
    ):
        got = output_maker(shape, torch.float32, CPU)().stride()
        assert got == torch.empty(shape).stride(), shape


def test_outputs_follow_the_callers_inference_mode():
    """A plan made in one mode serves calls in the other (the replay rebuilds its guard):
    its outputs are inference tensors exactly when torch.empty's would be."""
    make = output_maker((2, 3), torch.float32, CPU)
    with torch.inference_mode():
        assert make().is_inference()
        made_inside = output_maker((2, 3), torch.float32, CPU)
    assert not make().is_inference() and not made_inside().is_inference()


class FakeRaw:
    """A raw allocator that records its calls; ``device`` is the current device."""

    def __init__(self, device: int = 0):
        self.device, self.calls = device, []

    def allocator(self) -> RawAllocator:
        def new(nbytes, stream):
            self.calls.append(("alloc", nbytes, stream))
            return 4096 * len(self.calls)

        return RawAllocator(new, lambda a: self.calls.append(("delete", a)), lambda: self.device)


def test_scratch_takes_raw_memory_on_the_current_device_and_gives_it_back():
    raw = FakeRaw()
    scratch = Scratch(2048, CPU, 0, raw.allocator())
    address, held = scratch.take(stream=77)
    assert held is None and raw.calls == [("alloc", 2048, 77)]
    scratch.give(address, held)
    assert raw.calls[1:] == [("delete", address)]


def test_scratch_elsewhere_or_without_raw_memory_is_a_held_buffer():
    """The raw allocator allocates on the current device: another device's scratch (or no
    raw allocator) is a torch.empty buffer, alive until give, and never deleted raw."""
    raw = FakeRaw(device=1)
    for scratch in (Scratch(100, CPU, 0, raw.allocator()), Scratch(100, CPU, 0, None)):
        address, held = scratch.take(stream=0)
        assert held is not None and held.numel() == 100 and address == held.data_ptr()
        scratch.give(address, held)
    assert raw.calls == []


def test_raw_memory_only_where_the_caching_allocator_serves(monkeypatch):
    calls = dict(
        _cuda_cudaCachingAllocator_raw_alloc=lambda n, s: 1,
        _cuda_cudaCachingAllocator_raw_delete=lambda a: None,
        _cuda_getDevice=lambda: 0,
    )
    cuda = torch.device("cuda", 0)
    assert raw_allocator(CPU) is None
    for name, fn in calls.items():
        monkeypatch.setattr(torch._C, name, fn, raising=False)
    assert raw_allocator(CPU) is None  # another device type
    assert raw_allocator(cuda) == RawAllocator(*calls.values())
    monkeypatch.setattr(
        torch._C, "_cuda_cudaCachingAllocator_is_enabled", lambda: False, raising=False
    )
    assert raw_allocator(cuda) is None  # caching off: tensors are cudaMalloc'd, so is scratch
    monkeypatch.setattr(torch._C, "_cuda_cudaCachingAllocator_is_enabled", lambda: True)
    assert raw_allocator(cuda) is not None
    monkeypatch.setenv(alloc.UNCACHED_ENV, "1")
    assert raw_allocator(cuda) is None
