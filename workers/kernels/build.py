"""Native CPU kernels: built at first use with the machine's C++ compiler, then cached.

`load_library(source)` compiles one C++ file against the running torch (no ninja, no Python
headers: a plain shared library whose `TORCH_LIBRARY` block registers `torch.ops.cachesvc.*`),
caches the library under a key of the source, torch's version, the compiler and the CPU, and
loads it. Where there is no compiler, or the build fails, it returns False and the caller keeps
its torch path; a failed build is remembered in the cache, so other processes do not pay for it
again. Concurrent first uses (several workers starting) build once, under a lock.
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

# The instruction sets the build may use, by the vector capability torch detects at run time:
# a library in a cache shared by different machines then runs on every machine of its key.
_ARCH_FLAGS = {
    "AVX512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"),
    "AVX2": ("-mavx2", "-mfma"),
}


def cpu_capability() -> str:
    """The vector level the kernels are built for: torch's, e.g. `AVX512`, `AVX2`, `DEFAULT`."""
    return torch.backends.cpu.get_cpu_capability()


def _cache_root() -> Path:
    """A writable folder that survives the process: inside the virtualenv, else ~/.cache."""
    venv = Path(sys.prefix)
    if sys.prefix != sys.base_prefix and os.access(venv, os.W_OK):
        return venv / "var" / "cachesvc-ext"
    return Path.home() / ".cache" / "cachesvc" / "ext"


# The headers every kernel may include (`#include "vec_math.h"`): on the include path, and part
# of every kernel's cache key.
_SHARED_HEADERS = Path(__file__).with_name("csrc")


def _build_key(source: Path, compiler: str) -> str:
    digest = hashlib.sha256()
    for part in (source.read_bytes(), torch.__version__.encode(), compiler.encode()):
        digest.update(part)
    for folder in (_SHARED_HEADERS, source.parent):  # headers it may include
        for header in sorted(folder.glob("*.h")):
            digest.update(header.read_bytes())
    digest.update(f"{platform.machine()}-{cpu_capability()}".encode())
    return digest.hexdigest()[:16]


def _compile_command(compiler: str, source: Path, output: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths, library_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    lib_dirs = library_paths()
    return [
        compiler,
        "-O3",
        *_ARCH_FLAGS.get(cpu_capability(), ()),
        "-fopenmp",
        "-shared",
        "-fPIC",
        "-std=c++20",
        "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{_SHARED_HEADERS}",
        *(f"-I{p}" for p in include_paths()),
        str(source),
        *(f"-L{p}" for p in lib_dirs),
        *(f"-Wl,-rpath,{p}" for p in lib_dirs),
        "-lc10",
        "-ltorch_cpu",
        "-o",
        str(output),
    ]


def build(source: Path, compiler: str, folder: Path) -> Path | None:
    """The library of `source` in `folder`, built now unless a process built it (or failed to)
    before; None when the build failed, now or then."""
    library = folder / f"{source.stem}{sysconfig.get_config_var('SHLIB_SUFFIX') or '.so'}"
    failed = folder / "build-failed.log"
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build; the others wait and then load it
        if library.exists():
            return library
        if failed.exists():
            return None
        logger.info("building the CPU kernel %s (once per machine and torch)", source.name)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            partial = Path(tmp) / library.name
            done = subprocess.run(
                _compile_command(compiler, source, partial),
                capture_output=True,
                text=True,
                check=False,
            )
            if done.returncode != 0:
                failed.write_text(done.stderr)
                logger.warning("kernel build of %s failed, see %s", source.name, failed)
                return None
            partial.rename(library)  # atomic: a reader never sees half a library
    return library


@cache
def load_library(source: Path) -> bool:
    """Whether the ops `source` registers are loaded, building them on first call (once per
    process: the answer is cached, a failure included)."""
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None or sys.platform != "linux":
        return False
    try:
        library = build(source, compiler, _cache_root() / _build_key(source, compiler))
        if library is None:
            return False
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError) as exc:
        logger.warning("CPU kernel %s unavailable (%s); using torch's ops", source.name, exc)
        return False
    return True
