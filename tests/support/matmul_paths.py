"""Run a kernel test on each many-row matmul path this CPU has: the AMX tiles (where they run) and
the vector kernels, which take every row where the tiles are off."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvgen.kernels import amx_tiles


@pytest.fixture(params=["default", "amx-off"])
def matmul_path(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "amx-off":
        if not amx_tiles():
            pytest.skip("no AMX tiles run here, so the default case already runs the vector kernels")
        amx_tiles(False)
        try:
            yield request.param
        finally:
            amx_tiles(True)
    else:
        yield request.param
