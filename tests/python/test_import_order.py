"""weightsync and PyTorch in one process, imported in either order.

PyTorch's wheels bring their own CUDA runtime and NCCL, newer than a system
toolkit's. weightsync._core must bring neither as a shared library: the CUDA
runtime is linked statically and NCCL is loaded at run time, reusing the one
already in the process (docs/transports.md). When _core linked the system
libnccl.so.2, `import weightsync; import torch` failed with
"libtorch_cuda.so: undefined symbol: ncclCommResume".
"""

from __future__ import annotations

import ast
import importlib.util
import shutil
import struct
import subprocess
import sys

import pytest

# A child prints the distinct libnccl / libcudart files mapped into it after
# both imports (Linux: /proc/self/maps), so that a second copy shows.
CHILD = """
import sys
{imports}
import torch
x = torch.arange(4) * 2
assert x.tolist() == [0, 2, 4, 6], x
maps = set()
if sys.platform.startswith("linux"):
    with open("/proc/self/maps") as f:
        maps = {{line.split()[-1] for line in f if "libnccl" in line or "libcudart" in line}}
print("MAPPED", sorted(maps))
"""

ORDERS = {
    "weightsync_first": "import weightsync\nimport torch",
    "torch_first": "import torch\nimport weightsync",
}


@pytest.mark.parametrize("order", sorted(ORDERS))
def test_both_import_orders_work_in_a_fresh_process(order, tmp_path):
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    # A fresh interpreter: this process has imported both already. The temp
    # directory as cwd keeps the source tree's python/ off sys.path.
    proc = subprocess.run([sys.executable, "-c", CHILD.format(imports=ORDERS[order])],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, (
        f"{ORDERS[order]!r} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    mapped = [line for line in proc.stdout.splitlines() if line.startswith("MAPPED")]
    assert len(mapped) == 1, proc.stdout
    files = ast.literal_eval(mapped[0][len("MAPPED"):].strip())
    for lib in ("libnccl", "libcudart"):
        copies = [f for f in files if lib in f.rsplit("/", 1)[-1]]
        assert len(copies) <= 1, f"two {lib} in one process after {ORDERS[order]!r}: {copies}"


def elf_needed(path: str) -> list[str]:
    """The DT_NEEDED entries of a 64-bit little-endian ELF shared object."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, (
        f"{path}: expected a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
                for i in range(shnum)]
    SHT_DYNAMIC, DT_NULL, DT_NEEDED = 6, 0, 1
    needed = []
    for _name, sh_type, _flags, _addr, offset, size, link, *_rest in sections:
        if sh_type != SHT_DYNAMIC:
            continue
        strtab_offset = sections[link][4]
        for pos in range(offset, offset + size, 16):
            tag, value = struct.unpack_from("<qQ", data, pos)
            if tag == DT_NULL:
                break
            if tag == DT_NEEDED:
                end = data.index(b"\0", strtab_offset + value)
                needed.append(data[strtab_offset + value:end].decode())
    return needed


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads ELF files (Linux)")
def test_core_links_neither_nccl_nor_the_cuda_runtime():
    spec = importlib.util.find_spec("weightsync._core")
    assert spec is not None and spec.origin, "weightsync._core not found"
    needed = elf_needed(spec.origin)
    assert "libc.so.6" in needed, f"{spec.origin}: DT_NEEDED {needed} (the ELF reader is wrong?)"
    bad = [n for n in needed if n.startswith(("libnccl", "libcudart"))]
    assert not bad, f"{spec.origin} links {bad} (DT_NEEDED: {needed})"
    # ldd also shows what the needed libraries pull in.
    if shutil.which("ldd"):
        out = subprocess.run(["ldd", spec.origin], capture_output=True, text=True).stdout
        bad = [line.strip() for line in out.splitlines() if "libnccl" in line or "libcudart" in line]
        assert not bad, f"ldd {spec.origin}:\n{out}"
