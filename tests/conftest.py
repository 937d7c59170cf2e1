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


@pytest.fixture(autouse=True)
def _own_evidence_store(tmp_path_factory):
    """Each test reads and records evidence in a store of its own, never the user's nor
    another test's (plans read the store: one test's records would price another's plans;
    ``$METRALE_EVIDENCE``; subprocesses inherit it)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("METRALE_EVIDENCE",
                  str(tmp_path_factory.mktemp("evidence-store") / "evidence.sqlite"))
        yield
