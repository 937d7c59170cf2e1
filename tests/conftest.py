"""Test-wide settings: Hypothesis profiles (``ci``: derandomized and bounded; ``dev``: wider);
an evidence store of the tests' own."""

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=40,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev",
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


@pytest.fixture(scope="session", autouse=True)
def _no_user_evidence_store(tmp_path_factory):
    """Fixtures wider than a test (a module's plan) are made before a test's own store is set:
    they read one of the session's, never the user's (a `met tune` run on this machine
    changed which plan a display test drew)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("METRALE_EVIDENCE",
                  str(tmp_path_factory.mktemp("session-evidence-store") / "evidence.sqlite"))
        yield


@pytest.fixture(scope="session")
def analytic(tmp_path_factory):
    """The shipped kernels folder without its time records: its plans are priced by the
    analytic model and take the priorities' choices, whatever time records ship (the tests of
    the model, and of what a relation does where it applies, read it)."""
    from metrale.realize.evidence import without_time_records
    from metrale.realize.hardware import default_kernels_dir

    return without_time_records(default_kernels_dir(),
                                tmp_path_factory.mktemp("analytic") / "kernels")


@pytest.fixture(autouse=True)
def evidence_store(tmp_path_factory):
    """Each test reads and records evidence in a store of its own, never the user's nor
    another test's (plans read the store: one test's records would price another's plans;
    ``$METRALE_EVIDENCE``; subprocesses inherit it). A test that looks into it takes it by
    name: the store (metrale.realize.evidence_store.EvidenceStore, made on first use)."""
    from metrale.realize.evidence_store import EvidenceStore

    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("evidence-store") / "evidence.sqlite"
        mp.setenv("METRALE_EVIDENCE", str(path))
        yield EvidenceStore(path)


@pytest.fixture
def kernels(tmp_path):
    """A copy of the shipped kernels folder, for a test to add records or files to."""
    import shutil

    from metrale.realize.hardware import default_kernels_dir

    root = tmp_path / "kernels"
    shutil.copytree(default_kernels_dir(), root)
    return root


FULL_ENV = "METRALE_FULL_TESTS"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full", action="store_true", default=bool(os.environ.get(FULL_ENV)),
        help="also run the full tier (tests marked `full`: every NVIDIA class's every compile "
             f"unit, the emulation at every shape); also ${FULL_ENV}=1")


def full_tier(config: pytest.Config) -> bool:
    """Whether this run includes the full tier (``--full``)."""
    return bool(config.getoption("--full"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without ``--full``, the tests marked ``full`` are deselected (the run's summary counts
    them): the default run is the one CI runs, the full tier the one to run before a kernel or
    class change is merged."""
    if full_tier(config):
        return
    dropped = [item for item in items if item.get_closest_marker("full")]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if not item.get_closest_marker("full")]


def pytest_report_header(config: pytest.Config) -> str:
    return "tier: full" if full_tier(config) else "tier: default (the full tier: --full)"
