"""test_options.py's checks under FSDP1, in a file of their own: a second test worker runs them alongside FSDP2's."""

from __future__ import annotations

import pytest

from tests.distributed.test_options import *  # noqa: F403 - the same tests and fixtures, collected here again


@pytest.fixture(scope="module")
def version() -> int:
    return 1
