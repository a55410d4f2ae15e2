"""retain_freed_heap: a prefill step's big tensors reuse the heap instead of faulting in anew.

Each case is an engine over SmolLM2 in a fresh interpreter: the setting is process-wide and
cannot be undone, and the default has to be seen in a process that never had it. The engine
steps in a thread of its own, as the worker's does.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
        reason="glibc's malloc",
    ),
]

# Three prefill steps of 15 prompts of 80 tokens (1,200 rows: the gate/up output alone is
# 14.7 MB a layer); prints the minor page faults of the last one.
_PROGRAM = """
import resource, sys, threading, torch
from workers.config import EngineConfig
from workers.engine.engine import Engine
from workers.sampling_params import SamplingParams
def run():
    config = EngineConfig(num_threads=2, kv_cache_mb=128, retain_freed_heap=sys.argv[1] == "on")
    engine = Engine(config)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    ids = torch.Generator().manual_seed(0)
    for _ in range(3):
        for _ in range(15):
            engine.add_request(torch.randint(100, 40000, (80,), generator=ids).tolist(), params)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        engine.step()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
thread = threading.Thread(target=run)
thread.start()
thread.join()
"""


def _step_faults(retain: str) -> int:
    # glibc's default threshold moves with the blocks a process frees, so whether a step maps
    # its tensors afresh depends on what ran before it. Pinned at its starting value (128 KB)
    # every big block is mapped afresh without the setting, and the setting must override it.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 << 10)}
    done = subprocess.run(
        [sys.executable, "-c", _PROGRAM, retain],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    return int(done.stdout.strip().splitlines()[-1])


def test_a_prefill_step_faults_in_no_fresh_pages() -> None:
    assert _step_faults("on") < 1000


def test_without_it_the_same_step_faults_in_its_tensors_again() -> None:
    # The control: shows the case above measures the setting. One layer's gate/up output
    # mapped afresh is 3,600 pages of 4 KB, and a step maps it in each of 30 layers.
    assert _step_faults("off") > 10 * 3600
