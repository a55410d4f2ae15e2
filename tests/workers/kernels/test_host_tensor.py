"""The huge-page host tensors: an arena's tensors are independent, aligned and sized right, and
a weight packed into one equals its pack in torch's memory."""

from __future__ import annotations

import torch

from workers.kernels.host_tensor import HostArena, host_zeros
from workers.kernels.linear import pack


def test_arena_tensors_do_not_overlap_and_start_on_cache_lines() -> None:
    arena = HostArena(chunk_bytes=1 << 20)
    shapes = [(3, 5), (7,), (100, 33), (1,), (64, 64)]
    tensors = [arena.empty(shape, torch.float32) for shape in shapes]
    for i, t in enumerate(tensors):
        assert t.shape == shapes[i] and t.dtype == torch.float32 and t.is_contiguous()
        assert t.data_ptr() % 64 == 0
        t.fill_(float(i))
    for i, t in enumerate(tensors):  # a later write never reached an earlier tensor
        assert torch.equal(t, torch.full(shapes[i], float(i)))


def test_a_tensor_larger_than_a_chunk_gets_a_mapping_of_its_own() -> None:
    arena = HostArena(chunk_bytes=2 << 20)
    small = arena.empty((10,), torch.float32)
    big = arena.empty((3 << 20,), torch.float32)  # 12 MB
    after = arena.empty((10,), torch.bfloat16)
    big.fill_(2.0)
    small.fill_(1.0)
    after.fill_(3.0)
    assert big.numel() == 3 << 20 and bool((big == 2.0).all())
    assert bool((small == 1.0).all()) and bool((after == 3.0).all())
    assert after.dtype == torch.bfloat16


def test_host_zeros_are_zeros_of_the_shape() -> None:
    t = host_zeros((4, 3, 2), torch.bfloat16)
    assert t.shape == (4, 3, 2) and t.dtype == torch.bfloat16 and not bool(t.any())


def test_a_pack_in_an_arena_equals_the_pack_in_torch_memory() -> None:
    weight = torch.randn(130, 48)
    in_torch = pack(weight)
    in_arena = pack(weight, HostArena())
    assert torch.equal(in_torch, in_arena) and in_arena.is_contiguous()
