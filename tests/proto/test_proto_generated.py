"""The committed generated modules are what `make proto` produces from the .proto today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO = "proto/cachesvc/v1/cachesvc.proto"
GENERATED = ("cachesvc_pb2.py", "cachesvc_pb2.pyi", "cachesvc_pb2_grpc.py")


def test_generated_modules_are_fresh(tmp_path: Path) -> None:
    # The same command as the Makefile's `proto` target, into a temporary folder.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I",
            ".",
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            PROTO,
        ],
        cwd=ROOT,
        check=True,
    )
    folder = Path(PROTO).parent
    for name in GENERATED:
        fresh = (tmp_path / folder / name).read_text()
        committed = (ROOT / folder / name).read_text()
        assert committed == fresh, f"{folder / name} is stale: run `make proto` and commit it"


def test_generated_modules_import_as_documented() -> None:
    from proto.cachesvc.v1 import cachesvc_pb2, cachesvc_pb2_grpc

    assert cachesvc_pb2.DESCRIPTOR.package == "cachesvc.v1"
    assert set(cachesvc_pb2.DESCRIPTOR.services_by_name) == {"Inference", "Admin", "Cache"}
    assert hasattr(cachesvc_pb2_grpc, "InferenceStub")
