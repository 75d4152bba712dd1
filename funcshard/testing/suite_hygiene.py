"""A pytest plugin that fails the test that leaves the test process or a shared fixture changed,
rather than the later test that trips over it.

Two checks (see [Note: a task leaves its process as it found it] in process_state.py):
- process state: a snapshot when a test's setup starts, compared when its teardown ends (so a
  `monkeypatch` undone in teardown is no change); a difference is put back where it can be
  and fails that test's teardown, naming each change.
- shared fixtures: a digest of each module-, class-, package- or session-scoped fixture value a
  test uses, before and after its call; a test that mutates one (appends to a shared list,
  writes into a shared tensor) fails, naming the fixture. A value that does not pickle is not
  digested; the fixture's docstring should say it is shared read-only.
Opt in with `pytest_plugins = ["funcshard.testing.suite_hygiene"]` in a conftest.py (this
repository's does). Costs a snapshot per test and a pickle of each shared fixture it uses.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Iterator
from typing import Any

import pytest

from funcshard.testing import process_state

_BEFORE = pytest.StashKey[dict[str, Any]]()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    item.stash[_BEFORE] = process_state.snapshot()
    return (yield)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    result = yield
    before = item.stash.get(_BEFORE, None)
    if before is not None:
        found = process_state.changes(before, process_state.snapshot())
        if found:
            process_state.restore(before)
            raise process_state.changed_error(
                f"test {item.nodeid}",
                found,
                "Undo it in the test (monkeypatch, a `with` block or try/finally); what could "
                "be put back was, so the next test starts as this one did.",
            )
    return result


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    shared = _shared_fixtures(item)
    before = {name: _digest(value) for name, value in shared.items()}
    result = yield
    mutated = [
        name
        for name, value in shared.items()
        if before[name] is not None and _digest(value) != before[name]
    ]
    if mutated:
        raise AssertionError(
            f"test {item.nodeid} changed the shared fixture(s) {mutated}, which later tests "
            f"get as they are now. Copy the value before changing it (or make the fixture "
            f"function-scoped)."
        )
    return result


def _shared_fixtures(item: pytest.Item) -> dict[str, Any]:
    """The values of the fixtures `item` uses whose scope is wider than the function."""
    info = getattr(item, "_fixtureinfo", None)  # pytest's own record (no public accessor)
    funcargs = getattr(item, "funcargs", {})
    if info is None:
        return {}
    shared = {}
    for name, defs in info.name2fixturedefs.items():
        if defs and defs[-1].scope != "function" and name in funcargs:
            shared[name] = funcargs[name]
    return shared


def _digest(value: Any) -> bytes | None:
    """A digest of the pickled value; None where it does not pickle."""
    try:
        data = pickle.dumps(value)
    except Exception:
        return None
    return hashlib.blake2b(data, digest_size=16).digest()
