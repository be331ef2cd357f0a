"""A slice VM on the libvirt backend gets its own bridge (pyroute2, in a test network namespace):
the domain's NIC is on it while the VM lives, and release removes it."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import libvirt
import pytest

from agent.backends import FixedAddressProbe
from agent.backends.libvirt_slice import LibvirtSliceBackend
from agent.network.allocation_network import bridge_name
from agent.network.slice_networks import SliceNetworks
from tests.disk_images import write_base_image
from tests.test_agent_libvirt import IMAGE, provision_spec, release_spec
from tests.test_agent_network import links_by_name

HOST_XML = Path(__file__).parent / "data" / "libvirt" / "host.xml"


class Silent:
    def __call__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def cancelled(self) -> bool:
        return False

    def wait(self, seconds: float | None) -> None:
        pass

    def suspend_heartbeats(self) -> None:
        pass


@pytest.fixture
def backend(tmp_path: Path, ns: str) -> Iterator[tuple[LibvirtSliceBackend, Any]]:
    (tmp_path / "images").mkdir()
    content = write_base_image(tmp_path / "images" / IMAGE)
    conn = libvirt.open(f"test://{HOST_XML}")
    yield (
        LibvirtSliceBackend(
            f"test://{HOST_XML}",
            image_dir=tmp_path / "images",
            image_catalog={IMAGE: hashlib.sha256(content).hexdigest()},
            seed_dir=tmp_path / "seeds",
            state_dir=tmp_path / "state",
            readiness=FixedAddressProbe("10.20.0.5"),
            connection=conn,
            poll_interval_s=0.05,
            networks=SliceNetworks(netns=ns),
        ),
        conn,
    )
    conn.close()


def test_slice_vm_gets_its_own_bridge_and_release_removes_it(
    backend: tuple[LibvirtSliceBackend, Any], ns: str
) -> None:
    slices, conn = backend
    spec = provision_spec()
    bridge = bridge_name(spec.allocation_id)

    slices.provision_slice_vm(spec, Silent())  # type: ignore[arg-type]
    assert bridge in links_by_name(ns)
    xml = conn.lookupByName(f"gpc-{spec.allocation_id}").XMLDesc(0)
    assert "<interface type='bridge'>" in xml
    assert f"<source bridge='{bridge}'/>" in xml

    slices.release_slice_vm(release_spec(spec.allocation_id), Silent())  # type: ignore[arg-type]
    assert bridge not in links_by_name(ns)
