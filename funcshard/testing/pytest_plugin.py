"""A pytest plugin that lets `funcshard.testing.run` report a hang before pytest-timeout does.

pytest-timeout kills a test that overruns its limit with a stack of the test process only;
the runner's own timeout report says where every rank waited and which collective each issued
last. So while a test runs, this plugin tells the runner when the test's pytest-timeout will
fire, and `run` caps its timeout a margin before that. Registered as a pytest11 entry point;
it imports nothing itself, and does nothing without pytest-timeout or the runner.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from typing import Protocol, cast

import pytest


class _Runner(Protocol):  # the module funcshard.testing.runner, which this does not import
    DEADLINE: float | None


def _runner() -> _Runner | None:
    """The runner module if a test module imported it, else None."""
    return cast("_Runner | None", sys.modules.get("funcshard.testing.runner"))


def _pytest_timeout(item: pytest.Item) -> float | None:
    """The item's pytest-timeout in seconds (marker, command line or ini), if it has one."""
    if not item.config.pluginmanager.hasplugin("timeout"):
        return None
    try:
        import pytest_timeout

        timeout = pytest_timeout._get_item_settings(item).timeout  # no public accessor
    except Exception:  # another pytest-timeout version: no cap, as without this plugin
        return None
    return timeout if timeout and timeout > 0 else None


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    # Set at each attempt's setup, where pytest-timeout's clock starts (a rerun of the test
    # by pytest-rerunfailures gets a deadline of its own). Collection imported the test
    # modules: if none uses the runner, there is nothing to do.
    runner = _runner()
    timeout = _pytest_timeout(item) if runner is not None else None
    if runner is not None and timeout is not None:
        runner.DEADLINE = time.monotonic() + timeout
    yield


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    yield
    runner = _runner()
    if runner is not None:
        runner.DEADLINE = None
