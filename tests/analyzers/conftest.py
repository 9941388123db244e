"""Every implementation of the token passes: the compiled loops (analyzers/csrc) with torch's exp
inline where they take it so, the compiled loops with torch's exp between passes (a torch build whose
exp is not MKL's), and the torch ops (no compiler at install).

A test module that sets ``pytestmark = pytest.mark.usefixtures("kernel_path")`` runs every test on each
path, so parity with verl is shown for the code every kind of install runs.
"""

from __future__ import annotations

import pytest
from rlvitals.analyzers.fast import native


@pytest.fixture(params=["compiled", "compiled, exp between passes", "torch"])
def kernel_path(request):
    if request.param == "torch":
        with native.disabled():
            yield request.param
        return
    if native.module() is None:
        pytest.fail(f"the compiled token passes are not in use: {native.STATUS}")
    if request.param == "compiled":
        yield request.param
        return
    with native.exp_between_passes():
        yield request.param


@pytest.fixture(scope="session")
def synthetic_corpus():
    """The synthetic corpus (bench/_synthetic.py: every scenario on each of its seeds through the health
    monitor), replayed once per pytest process for the modules that score it and read its findings."""
    from bench._synthetic import load_synthetic

    return load_synthetic()
