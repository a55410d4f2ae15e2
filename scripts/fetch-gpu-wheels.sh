#!/usr/bin/env bash
# Fetch the wheels `make gpu-check` installs on an H200 into .whl/ (see docs/gpu.md).
#
# The device has Python 3.12, torch (cu130), numpy, jinja2, tokenizers, safetensors, xxhash,
# nvcc and ninja, but no registry: flashinfer, its tvm-ffi runtime and gguf must travel with the
# working tree, whose limit is 64 MiB. The flashinfer wheel (62 MB) carries the CUDA sources of
# every kernel family; the repack below keeps only the generators' inputs for the FA2 prefill,
# decode, cascade, page and quantization modules (research notes §8.3), which leaves ~29 MB.
#
# Usage: scripts/fetch-gpu-wheels.sh          (PYTHON=... to pick the interpreter that runs pip)
set -euo pipefail
cd "$(dirname "$0")/.."

# The one version FlashInferBackend accepts (FLASHINFER_VERSION); the gpu extra and the CUDA
# image pin the same, which tests/deploy/test_dockerfile.py checks.
FLASHINFER=flashinfer-python==0.7.2.post1
OTHERS=(apache-tvm-ffi==0.1.15.post2 gguf==0.19.0)
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
FULL=.cache/gpu-wheels  # the unmodified download stays out of the travelling tree
DOWNLOAD=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
    --platform manylinux2014_x86_64)

mkdir -p .whl "$FULL"
rm -f .whl/*.whl  # one version of each: two copies of a package stop the device's install
"$PYTHON" -m pip download -q "${DOWNLOAD[@]}" -d "$FULL" "$FLASHINFER"
"$PYTHON" -m pip download -q "${DOWNLOAD[@]}" -d .whl "${OTHERS[@]}"

"$PYTHON" - "$FULL" .whl <<'EOF'
"""Repack the flashinfer wheel with data/csrc cut to the files our JIT modules read."""
import sys
import zipfile
from pathlib import Path

KEEP_CSRC = {
    # FA2 batch prefill (paged + ragged) and its FA3 twin's templates, batch decode.
    "batch_decode.cu", "batch_decode_customize_config.jinja", "batch_decode_jit_binding.cu",
    "batch_decode_kernel_inst.jinja", "batch_prefill.cu", "batch_prefill_customize_config.jinja",
    "batch_prefill_jit_binding.cu", "batch_prefill_paged.cuh",
    "batch_prefill_paged_kernel_inst.jinja", "batch_prefill_paged_sm90_kernel_inst.jinja",
    "batch_prefill_ragged_kernel_inst.jinja", "batch_prefill_ragged_sm90_kernel_inst.jinja",
    "batch_prefill_sm90.cu", "batch_prefill_sm90_customize_config.jinja",
    "batch_prefill_sm90_jit_binding.cu",
    # merge_state*, append_paged_kv_cache, segment_packbits, and the shared FFI header.
    "cascade.cu", "flashinfer_cascade_binding.cu", "flashinfer_page_binding.cu",
    "flashinfer_quantization_binding.cu", "page.cu", "quantization.cu", "tvm_ffi_utils.h",
}
CSRC = "flashinfer/data/csrc/"

src_dir, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
(wheel,) = src_dir.glob("flashinfer_python-*.whl")
out = out_dir / wheel.name


def kept(name: str) -> bool:
    return not name.startswith(CSRC) or name[len(CSRC):] in KEEP_CSRC


with zipfile.ZipFile(wheel) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zout:
    for info in zin.infolist():
        if not kept(info.filename):
            continue
        data = zin.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            # RECORD lists every file with its hash; drop the lines of the files cut out.
            lines = data.decode().splitlines(keepends=True)
            data = "".join(line for line in lines if kept(line.split(",", 1)[0])).encode()
        zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
print(f"{out}: {out.stat().st_size / 2**20:.1f} MiB (from {wheel.stat().st_size / 2**20:.1f})")
EOF
du -ch .whl/*.whl | tail -1
