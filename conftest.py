"""Hypothesis profiles shared by tests/ and property_tests/: HYPOTHESIS_PROFILE=dev|ci|long
(long: what scripts/stress.sh runs, the recipe property test with 200 configurations)."""

import os

from hypothesis import HealthCheck, settings

# A test that leaves the test process or a shared fixture changed fails itself, not the next
# test (funcshard/testing/suite_hygiene.py); the rank pool checks its tasks the same way.
pytest_plugins = ["funcshard.testing.suite_hygiene"]

# Inductor compiles in one thread here: its default on this 2-core machine starts a pool of
# compile subprocesses per rank that costs more CPU than it saves (the inductor tests, the
# compiling guide's example). The one place this is set: before any rank pool or script
# starts, so they inherit it.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

settings.register_profile(
    "dev", max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
# ci: 25 draws where a test sets no count (was 50: the split laws' traces were most of it);
# a test that sets its own count keeps it, and every pinned @example always runs. The long
# profile (scripts/stress.sh) draws 200.
settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "long", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# The files that take longest run first: xdist hands a worker a whole file at a time, in this
# order, so a long file handed out last would run alone while the other workers sit idle.
# From tests/DURATIONS.md's latest per-file seconds, largest first; the rest keep their order.
LONGEST_FIRST = (
    "tests/project/test_readme.py",
    "tests/compiling/test_compile.py",
    "tests/testing/test_check.py",
    "tests/compiling/test_compiled_reshard.py",
    "tests/recipes/test_recovery.py",
    "tests/project/test_benchmarks.py",
    "tests/recipes/test_examples.py",
    "tests/compiling/test_compile_recipes.py",
    "tests/comm/test_progress.py",
    "tests/testing/test_runner.py",
)


def pytest_collection_modifyitems(items: list) -> None:
    place = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: place.get(item.nodeid.split("::")[0], len(LONGEST_FIRST)))
