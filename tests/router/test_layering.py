"""The router process stays light: serving gRPC must not load torch or the model code (the
import-linter contracts in pyproject.toml check the static imports; this checks what a real
import of the server pulls in, lazy imports at module level included)."""

from __future__ import annotations

import subprocess
import sys

_HEAVY = (
    "torch",
    "flashinfer",
    "workers.engine",
    "workers.peer",
    "workers.model",
    "workers.attention",
)


def test_importing_the_router_server_loads_no_torch_and_no_engine() -> None:
    code = (
        "import sys, router.grpc.server, router.bootstrap, router.core, router.pool.worker_pool; "
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {_HEAVY!r} "
        f"or m.startswith({_HEAVY!r})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_check_sees_torch_when_it_is_imported() -> None:
    # The same probe must catch a heavy import, or the test above proves nothing.
    code = (
        "import sys, router.grpc.server, torch; "
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {_HEAVY!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "torch" in out.stdout
