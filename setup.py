"""Maps the top-level folders onto the `rlvitals` namespace (works with editable installs).

analyzers/ -> rlvitals.analyzers, client/ -> rlvitals.client, service/ -> rlvitals.service,
examples/ -> rlvitals.examples (so `rlvitals demo` works from a wheel),
src/rlvitals/ -> rlvitals. Subpackages are found automatically.
"""

import hashlib
from pathlib import Path

from setuptools import Extension, find_packages, setup

ROOTS = {
    "rlvitals": "src/rlvitals",
    "rlvitals.analyzers": "analyzers",
    "rlvitals.client": "client",
    "rlvitals.service": "service",
    "rlvitals.examples": "examples",
}

packages = []
for package, folder in ROOTS.items():
    packages.append(package)
    packages += [f"{package}.{sub}" for sub in find_packages(folder)]

# The fused token passes of rlvitals.analyzers.fast.kernels (analyzers/csrc/_fused.c): optional, so an install
# without a C compiler still works (analyzers/fast/native.py then reports it absent and the kernels run
# torch ops). Built without fused multiply-add, so every per-token float is the one verl computes; the
# source's hash is compiled in, so a stale build is detected and not used.
CSRC = Path("analyzers/csrc")
# the hash analyzers/fast/native.py recomputes from these sources: every .c/.h file, in name order
SOURCE_SHA = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(CSRC.glob("*.[ch]")))).hexdigest()
fused = Extension(
    "rlvitals.analyzers._fused",
    [str(CSRC / "_fused.c")],
    depends=[str(p) for p in sorted(CSRC.glob("*.h"))],
    extra_compile_args=["-O3", "-ffp-contract=off", "-fno-strict-aliasing", "-Wno-psabi"],
    define_macros=[("RLV_SOURCE_SHA", f'"{SOURCE_SHA}"')],
    optional=True,
)

setup(package_dir=ROOTS, packages=packages, ext_modules=[fused])
