"""without_huge_pages: set for the block, restored after, also when the block fails."""

from __future__ import annotations

import ctypes
import sys

import pytest

from omni_core.data.memory import without_huge_pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl THP flag is Linux-only")


def _thp_disabled() -> int:
    return ctypes.CDLL(None).prctl(42, 0, 0, 0, 0)  # PR_GET_THP_DISABLE


def test_set_inside_and_restored_after_even_on_error():
    assert _thp_disabled() == 0
    with without_huge_pages():
        assert _thp_disabled() == 1
    assert _thp_disabled() == 0
    with pytest.raises(RuntimeError), without_huge_pages():
        assert _thp_disabled() == 1
        raise RuntimeError("boom")
    assert _thp_disabled() == 0


def test_nested_blocks_leave_an_outer_setting_alone():
    with without_huge_pages():
        with without_huge_pages():
            assert _thp_disabled() == 1
        assert _thp_disabled() == 1  # the inner block did not turn it back on
    assert _thp_disabled() == 0
