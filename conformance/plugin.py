"""The pytest plugin of the conformance suite (entry point `pytest11`).

`pytest --pyargs conformance.suite --hal-vendor NAME [--hal-depth quick|full]` runs the suite
against the vendor registered as NAME in `hal.vendors`. The plugin adds the options, the
fixtures the suite uses (`hal_vendor`, `fresh_hal_vendor`, `hal_depth`), and copies each
test's capability label into its report (`user_properties`), so that the label survives
pytest-xdist.

The depth sizes the shape sweeps and property tests: `quick` (the default) is for CI on a
CPU; `full` adds the shapes of large models (thousands of tokens, 256 experts, wide hidden
sizes) and more property examples, for accelerators.

It is loaded in every pytest session of an environment where moe-hal is installed, so
it imports `hal` (and torch) only when a suite test asks for a vendor.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from hal import Vendor

#: The marker naming a test's capability label (see `conformance.capability`).
MARKER = "hal_capability"
#: The `user_properties` key the label is reported under.
PROPERTY = "hal_capability"
#: How deep the shape sweeps and property tests go: CI on a CPU, or the shapes of large models.
DEPTHS = ("quick", "full")
DEFAULT_DEPTH = "quick"


def pytest_addoption(parser: pytest.Parser) -> None:
    """Add `--hal-vendor NAME` and `--hal-depth quick|full`."""
    group = parser.getgroup("hal", "moe-hal conformance suite")
    group.addoption(
        "--hal-vendor",
        dest="hal_vendor",
        metavar="NAME",
        default=None,
        help="run the moe-hal conformance suite against this vendor (a hal.vendors entry point)",
    )
    group.addoption(
        "--hal-depth",
        dest="hal_depth",
        choices=DEPTHS,
        default=DEFAULT_DEPTH,
        help="shape sweeps and property tests: quick (CI on a CPU, the default) or full "
        "(the shapes of large models, for accelerators)",
    )


def depth_of(config: pytest.Config) -> str:
    """The `--hal-depth` of a session: `quick` or `full`."""
    return str(config.getoption("hal_depth", default=DEFAULT_DEPTH) or DEFAULT_DEPTH)


def pytest_configure(config: pytest.Config) -> None:
    """Register the capability marker; refuse to run the suite where `assert` is compiled away; give
    each pytest-xdist worker of a suite run its share of the CPU threads."""
    config.addinivalue_line("markers", f"{MARKER}(label): the conformance-matrix row a test belongs to")
    if config.getoption("hal_vendor") and sys.flags.optimize:
        raise pytest.UsageError(
            "--hal-vendor: the conformance suite checks with assert statements, which "
            "python -O removes; run it without -O"
        )
    workerinput = getattr(config, "workerinput", None)
    if config.getoption("hal_vendor") and workerinput is not None:
        share_threads(int(workerinput.get("workercount", 1)))


def share_threads(workers: int) -> int:
    """Cap this process's torch threads at its share of the CPUs among `workers` processes, and return
    the cap. Each xdist worker would otherwise start one thread per CPU for the float64 references:
    15 workers on 16 CPUs ran 240 threads, and the full-depth suite on an H100 host took over 9
    minutes, the references stalled behind each other."""
    import torch

    share = max(1, _cpu_count() // max(1, workers))
    if torch.get_num_threads() > share:
        torch.set_num_threads(share)
    return share


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not every platform has affinity
        return os.cpu_count() or 1


def pytest_sessionstart(session: pytest.Session) -> None:
    """Refuse an unknown or unavailable vendor once, with its reason, instead of failing every test."""
    name = session.config.getoption("hal_vendor")
    if not name:
        return
    from hal import HalError, VendorRegistry

    try:
        VendorRegistry.discover().select(name)
    except HalError as exc:
        raise pytest.UsageError(f"--hal-vendor {name}: {exc}") from None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Copy each test's capability label into its reports."""
    for item in items:
        marker = item.get_closest_marker(MARKER)
        if marker is not None and marker.args:
            item.user_properties.append((PROPERTY, str(marker.args[0])))


@pytest.fixture(scope="session")
def hal_vendor_name(request: pytest.FixtureRequest) -> str:
    """The vendor named with `--hal-vendor` (the suite's tests skip without one)."""
    name = request.config.getoption("hal_vendor")
    if not name:
        pytest.skip("the conformance suite needs a vendor: run pytest with --hal-vendor NAME")
    return str(name)


@pytest.fixture(scope="session")
def fresh_hal_vendor(hal_vendor_name: str) -> Callable[[], Vendor]:
    """A factory of new instances of the vendor, built through its entry point each time."""
    from hal import VendorRegistry

    def build() -> Vendor:
        return VendorRegistry.discover().select(hal_vendor_name).vendor

    return build


@pytest.fixture(scope="session")
def hal_vendor(fresh_hal_vendor: Callable[[], Vendor]) -> Vendor:
    """The vendor under test: one instance for the session (capabilities are resolved once)."""
    return fresh_hal_vendor()


@pytest.fixture(scope="session")
def hal_depth(request: pytest.FixtureRequest) -> str:
    """The `--hal-depth` of the session: "quick" (CI on a CPU) or "full" (large-model shapes)."""
    return depth_of(request.config)
