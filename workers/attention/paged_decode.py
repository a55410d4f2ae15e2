"""The CPU paged-decode kernel (`csrc/paged_decode.cpp`): built at first use, then cached.

`load()` compiles the C++ source with the machine's compiler against the running torch (no
ninja, no Python headers: a plain shared library that registers `torch.ops.cachesvc.
paged_decode`), caches the library under a key of the source, torch's version and the CPU, and
loads it. Where there is no compiler, or the build fails, it returns False once and the torch
backend keeps its gather path; a failed build is remembered in the cache, so other processes do
not pay for it again. Concurrent first uses (several workers starting) build once, under a lock.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from functools import cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "paged_decode.cpp"
_LIBRARY = "paged_decode"


# The instruction sets the build may use, by the vector capability torch detects at run time:
# a library in a cache shared by different machines then runs on every machine of its key.
_ARCH_FLAGS = {
    "AVX512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"),
    "AVX2": ("-mavx2", "-mfma"),
}


def _cpu_capability() -> str:
    return f"{platform.machine()}-{torch.backends.cpu.get_cpu_capability()}"


def _cache_root() -> Path:
    """A writable folder that survives the process: inside the virtualenv, else ~/.cache."""
    venv = Path(sys.prefix)
    if sys.prefix != sys.base_prefix and os.access(venv, os.W_OK):
        return venv / "var" / "cachesvc-ext"
    return Path.home() / ".cache" / "cachesvc" / "ext"


def _build_key(compiler: str) -> str:
    digest = hashlib.sha256()
    for part in (_SOURCE.read_bytes(), torch.__version__.encode(), compiler.encode()):
        digest.update(part)
    digest.update(_cpu_capability().encode())
    return digest.hexdigest()[:16]


def _compile_command(compiler: str, output: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths, library_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    lib_dirs = library_paths()
    return [
        compiler,
        "-O3",
        *_ARCH_FLAGS.get(torch.backends.cpu.get_cpu_capability(), ()),
        "-fopenmp",
        "-shared",
        "-fPIC",
        "-std=c++20",
        "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{p}" for p in include_paths()),
        str(_SOURCE),
        *(f"-L{p}" for p in lib_dirs),
        *(f"-Wl,-rpath,{p}" for p in lib_dirs),
        "-lc10",
        "-ltorch_cpu",
        "-o",
        str(output),
    ]


def _build(compiler: str, folder: Path) -> Path | None:
    """The library in `folder`, built now unless a process built it (or failed to) before."""
    library = folder / f"{_LIBRARY}{sysconfig.get_config_var('SHLIB_SUFFIX') or '.so'}"
    failed = folder / "build-failed.log"
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build; the others wait and then load it
        if library.exists():
            return library
        if failed.exists():
            return None
        logger.info("building the CPU paged-decode kernel (once per machine and torch)")
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            partial = Path(tmp) / library.name
            done = subprocess.run(
                _compile_command(compiler, partial), capture_output=True, text=True, check=False
            )
            if done.returncode != 0:
                failed.write_text(done.stderr)
                logger.warning("paged-decode kernel build failed, see %s", failed)
                return None
            partial.rename(library)  # atomic: a reader never sees half a library
    return library


@cache
def load() -> bool:
    """Whether `torch.ops.cachesvc.paged_decode` is available, building it on first call."""
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None or sys.platform != "linux":
        return False
    try:
        library = _build(compiler, _cache_root() / _build_key(compiler))
        if library is None:
            return False
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError) as exc:
        logger.warning("paged-decode kernel unavailable (%s); gathering pages instead", exc)
        return False
    return True


def paged_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_indices: torch.Tensor,
    requests: torch.Tensor,
    sm_scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """Attention of one query row per request over its pages, in place; `load()` must be True.

    `q [N, Hq, D]`, `kv_cache [pages, 2, page_size, Hk, D]` (same dtype), `kv_indices` int32 (the
    layout's), `requests` int64 `[n, 3]`: each request's query row, the offset of its first page
    in `kv_indices`, and its KV length. Writes those rows of `out [N, Hq, D]` (q's dtype) and of
    the base-2 LSE `lse [N, Hq]` (float32); other rows are left as they are.
    """
    torch.ops.cachesvc.paged_decode(q, kv_cache, kv_indices, requests, sm_scale, out, lse)
