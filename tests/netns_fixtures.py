"""Network-namespace fixtures: `ns` is a fresh namespace per test, always removed; the host's own
namespace is compared before and after (`host_untouched`), so no test may touch it."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
from pyroute2 import IPRoute, netns

from agent.network import dump_state


@pytest.fixture
def host_untouched() -> Iterator[None]:
    before = dump_state(None)
    yield
    assert dump_state(None) == before, "a test changed the host's network namespace"


@pytest.fixture
def ns(host_untouched: None) -> Iterator[str]:
    """A fresh, empty network namespace (loopback up), removed at teardown even on failure."""
    if os.geteuid() != 0:
        pytest.skip("creating network namespaces needs root (CAP_SYS_ADMIN)")
    name = f"gct-{uuid.uuid4().hex[:10]}"
    try:
        netns.create(name)
    except OSError as exc:
        pytest.skip(f"this environment forbids creating network namespaces: {exc}")
    try:
        with IPRoute(netns=name, flags=0) as ipr:
            ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
        yield name
    finally:
        netns.remove(name)
    assert name not in netns.listnetns()
