"""Both implementations of the token passes: the compiled loops (analyzers/csrc) and the torch ops.

A test module that sets ``pytestmark = pytest.mark.usefixtures("kernel_path")`` runs every test twice,
once on each path, so parity with verl is shown for the code a server without a C compiler runs too.
"""

from __future__ import annotations

import pytest
from rlvitals.analyzers import native


@pytest.fixture(params=["compiled", "torch"])
def kernel_path(request):
    if request.param == "torch":
        with native.disabled():
            yield request.param
        return
    if native.module() is None:
        pytest.fail(f"the compiled token passes are not in use: {native.STATUS}")
    yield request.param
