"""A pytest plugin that lets `funcshard.testing.run` report a hang before pytest-timeout does.

pytest-timeout kills a test that overruns its limit with a stack of the test process only;
the runner's own timeout report says where every rank waited and which collective each issued
last. So while a test runs, this plugin tells the runner when the test's pytest-timeout will
fire, and `run` caps its timeout a margin before that. Registered as a pytest11 entry point.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from funcshard.testing import runner


def _pytest_timeout(item: pytest.Item) -> float | None:
    """The item's pytest-timeout in seconds (marker, command line or ini), if any."""
    try:
        import pytest_timeout
    except ImportError:
        return None
    timeout = pytest_timeout._get_item_settings(item).timeout
    return timeout if timeout and timeout > 0 else None


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    timeout = _pytest_timeout(item)
    if timeout is not None and item.config.pluginmanager.hasplugin("timeout"):
        runner.DEADLINE = time.monotonic() + timeout
    try:
        yield
    finally:
        runner.DEADLINE = None
