"""The default tier samples a parametrized matrix; the full tier runs all of it."""

import pytest

from tests.conftest import pytest_collection_modifyitems
from tests.tiers import sampled


def _full(case) -> bool:
    return any(m.name == "full" for m in getattr(case, "marks", ()))


def test_sampled_keeps_the_chosen_cases_and_marks_the_rest_full():
    cases = sampled([1, (2, "b"), pytest.param(3, id="three", marks=pytest.mark.slow)], keep=[0])
    assert cases[0] == 1 and [_full(c) for c in cases] == [False, True, True]
    assert cases[1].values == (2, "b")
    assert cases[2].id == "three" and {m.name for m in cases[2].marks} == {"slow", "full"}
    with pytest.raises(AssertionError):
        sampled([1, 2], keep=[2])


class _Item:
    def __init__(self, full: bool) -> None:
        self.full = full

    def get_closest_marker(self, name):
        return name if name == "full" and self.full else None


class _Config:
    def __init__(self, full: bool) -> None:
        self.deselected: list = []
        self.hook = self
        self.full = full

    def getoption(self, name):
        assert name == "--full"
        return self.full

    def pytest_deselected(self, items):
        self.deselected += items


@pytest.mark.parametrize("full", [False, True])
def test_the_full_tier_is_deselected_unless_asked_for(full):
    items = [_Item(False), _Item(True), _Item(False)]
    config = _Config(full)
    pytest_collection_modifyitems(config, items)
    assert len(items) == (3 if full else 2) and all(full or not i.full for i in items)
    assert len(config.deselected) == (0 if full else 1)
