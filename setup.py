"""Maps the top-level folders onto the `rlvitals` namespace (works with editable installs).

analyzers/ -> rlvitals.analyzers, client/ -> rlvitals.client, service/ -> rlvitals.service,
examples/ -> rlvitals.examples (so `rlvitals demo` works from a wheel),
src/rlvitals/ -> rlvitals. Subpackages are found automatically.
"""

from setuptools import find_packages, setup

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

setup(package_dir=ROOTS, packages=packages)
