"""Host buffers: zeroed, writable, their own memory, usable while a background thread faults
them in (which never changes what was written)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from cachesvc.kv.host_memory import host_buffer, populate_pages


@pytest.mark.parametrize("populate", ["now", "background", "lazy"])
def test_buffers_are_zeroed_writable_and_separate(populate: str) -> None:
    a, b = host_buffer(3 << 20, populate), host_buffer(3 << 20, populate)
    assert a.dtype == np.uint8 and a.nbytes == 3 << 20 and not a.any()
    a[::4096] = 7
    assert not b.any() and int(a.sum()) == 7 * 768
    as_tensor = torch.from_numpy(a).view(torch.float32)  # the KV cache's use of it
    as_tensor[0] = 1.5
    assert a[:4].view(np.float32)[0] == 1.5


def test_populating_while_writing_keeps_every_write() -> None:
    buf = host_buffer(64 << 20, populate="lazy")
    done = threading.Event()

    def populate() -> None:
        populate_pages(buf)
        done.set()

    thread = threading.Thread(target=populate)
    thread.start()
    for i in range(0, buf.nbytes, 1 << 20):  # write while the kernel faults pages in
        buf[i] = 1 + (i >> 20) % 200
    thread.join()
    assert done.is_set()
    assert all(buf[i] == 1 + (i >> 20) % 200 for i in range(0, buf.nbytes, 1 << 20))
    assert int(np.count_nonzero(buf)) == buf.nbytes >> 20


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="populate must be"):
        host_buffer(10, "eager")
    assert host_buffer(0).nbytes == 0
