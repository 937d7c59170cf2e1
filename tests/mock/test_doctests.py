"""Every module's docstring laws run as doctests, imported under their installed names."""

import doctest
import importlib
import pkgutil

import pytest

import metrale

PACKAGES = ["metrale", "metrale.lkb", "metrale.realize", "metrale.plan", "metrale.runtime"]


def _modules() -> list[str]:
    names = []
    for pkg_name in PACKAGES:
        pkg = importlib.import_module(pkg_name)
        names.append(pkg_name)
        for info in pkgutil.iter_modules(pkg.__path__):
            if info.name != "__main__":  # running it is `met`; it has no docstring laws
                names.append(f"{pkg_name}.{info.name}")
    return sorted(set(names))


@pytest.mark.parametrize("name", _modules())
def test_module_doctests(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} doctest(s) failed in {name}"


def test_doctests_are_collected() -> None:
    assert len(_modules()) >= 8
    assert metrale.__version__
