"""A namespace's quota is enforced by the export's filesystem and its usage read from that
filesystem's accounting (issue 37 item 3), on the production path: the export is a real btrfs
with quotas enabled, loop-mounted (tests/btrfs_export.py); namespaces are created, attached,
written through the node's mount, measured by the meter and deleted through the tenant API and
the real worker and agent; run as root.

- A namespace of 8 MiB takes 7 MiB and refuses the write that crosses 8 MiB with EDQUOT, though
  the writer is mounted (and root): the kernel stops it, not the attach precheck.
- The namespace view's used_bytes is the filesystem's account of it, not a walk: it counts 3 MiB
  that no walk can reach (a directory of the namespace with a filesystem mounted over it), and
  matches what was written within a few blocks.
- Deleting the namespace frees its space: its quota group goes, and the filesystem's free space
  comes back.
- A full namespace still takes a read_only attachment.
- An export without filesystem quotas says so (hard_quota False, logged) and keeps the walk.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import errno
import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client

from activities.storage_provider import SharedDirectoryProvider, walked_usage_bytes
from tests import test_storage_attachments as attachment_tests
from tests.btrfs_export import btrfs_quota_export
from tests.lifecycle_support import Tenant, eventually
from tests.test_storage_attachments import (
    StartStorageAgent,
    active_allocation,
    attach,
    create_namespace,
    wait_attachment,
)
from tests.test_storage_billing import meter
from tests.test_storage_namespace_lifecycle import detach, wait_namespace

pytestmark = [
    pytest.mark.usefixtures("control_plane"),
    pytest.mark.skipif(os.geteuid() != 0, reason="loop and bind mounts need root"),
]
MIB = 1 << 20
# What btrfs accounts beyond the data: the subvolume's tree blocks (16 KiB each).
METADATA_SLACK = 256 * 1024
start_storage_agent = attachment_tests.start_storage_agent


@pytest.fixture(autouse=True)
def storage_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The provider's export for the worker (set before it starts) and the agents: a btrfs with
    quotas enabled, in place of the attachment tests' plain directory."""
    with btrfs_quota_export(tmp_path) as root:
        monkeypatch.setenv("GPUCLOUD_STORAGE_ROOT", str(root))
        yield root


def write(path: Path, size: int) -> None:
    with path.open("wb") as out:
        out.write(os.urandom(size))
        out.flush()
        os.fsync(out.fileno())


async def test_the_filesystem_enforces_the_quota_and_accounts_usage_without_a_walk(
    tenant: Tenant, db_sessions: Any, start_storage_agent: StartStorageAgent,
    storage_root: Path, temporal_client: Client, settings: Any,
) -> None:  # fmt: skip
    provider = SharedDirectoryProvider(storage_root)
    assert provider.capabilities.hard_quota
    allocation_id, node = await active_allocation(tenant, db_sessions, start_storage_agent)
    namespace = await create_namespace(tenant.client, "bounded", quota_bytes=8 * MIB)
    ns_id = namespace["id"]
    group = provider.quota_group(ns_id)
    assert group is not None
    assert group.limit_bytes() == 8 * MIB

    attachment = await attach(tenant.client, allocation_id, ns_id, "single_writer")
    aid = attachment["attachment_id"]
    await wait_attachment(tenant.client, allocation_id, aid, "mounted")
    mount = node.mount_dir(aid)
    # 7 MiB through the tenant's mount: taken.
    write(mount / "visible.bin", 4 * MIB)
    (mount / "hidden").mkdir()
    write(mount / "hidden" / "under.bin", 3 * MIB)

    # A filesystem mounted over hidden/ on the worker's side: a walk of the namespace now sees
    # an empty directory there, the filesystem's account still has the 3 MiB beneath it.
    data_dir = storage_root / "namespaces" / ns_id
    covered = data_dir / "hidden"
    await asyncio.to_thread(
        subprocess.run, ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(covered)], check=True
    )
    try:
        assert walked_usage_bytes(data_dir) < 5 * MIB
        os.sync()  # the accounting is as of the last commit
        await meter(temporal_client, settings, dt.datetime.now(dt.UTC))
        view = (await tenant.client.get(f"/api/v1/storage/namespaces/{ns_id}")).json()
    finally:
        await asyncio.to_thread(subprocess.run, ["umount", str(covered)], check=True)
    assert view["usage_measured_at"] is not None
    assert 7 * MIB <= view["used_bytes"] <= 7 * MIB + METADATA_SLACK, view
    assert group.referenced_bytes() == view["used_bytes"]

    # The write that crosses 8 MiB is refused by the kernel, through the mounted writer.
    with pytest.raises(OSError, match="Disk quota exceeded") as refused:
        write(mount / "overflow.bin", 2 * MIB)
    assert refused.value.errno == errno.EDQUOT
    assert (mount / "overflow.bin").stat().st_size < 2 * MIB
    os.sync()
    assert group.referenced_bytes() <= 8 * MIB

    # Deleted: the data goes, and with it the namespace's quota group and its space.
    free_before = os.statvfs(storage_root).f_bavail * os.statvfs(storage_root).f_frsize
    await detach(tenant, allocation_id, aid)
    response = await tenant.client.delete(f"/api/v1/storage/namespaces/{ns_id}")
    assert response.status_code == 202, response.text
    await wait_namespace(tenant.client, ns_id, "deleted")
    assert not data_dir.exists()

    async def freed() -> bool:
        os.sync()
        free = os.statvfs(storage_root).f_bavail * os.statvfs(storage_root).f_frsize
        return not group.sysfs.exists() and free - free_before >= 7 * MIB

    await eventually(freed, timeout=60, interval=0.5)


async def test_a_namespace_at_its_quota_still_takes_a_reader(
    tenant: Tenant, db_sessions: Any, start_storage_agent: StartStorageAgent, storage_root: Path
) -> None:
    """A full namespace (the filesystem refuses its next write) still takes a read_only
    attachment: its grant writes nothing into the namespace (an ACL rewritten on every grant
    was refused with EDQUOT, and the attachment failed)."""
    allocation_id, node = await active_allocation(tenant, db_sessions, start_storage_agent)
    namespace = await create_namespace(tenant.client, "full", quota_bytes=MIB)
    data_dir = storage_root / "namespaces" / namespace["id"]
    with pytest.raises(OSError, match="Disk quota exceeded") as refused:
        write(data_dir / "fill.bin", 2 * MIB)
    assert refused.value.errno == errno.EDQUOT
    reader = await attach(tenant.client, allocation_id, namespace["id"], "read_only")
    await wait_attachment(tenant.client, allocation_id, reader["attachment_id"], "mounted")
    assert (node.mount_dir(reader["attachment_id"]) / "fill.bin").stat().st_size > 0


def test_an_export_without_filesystem_quotas_says_so_and_keeps_the_walk(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plain = SharedDirectoryProvider(tmp_path / "plain-export")
    assert not plain.capabilities.hard_quota
    assert "not a btrfs filesystem" in (plain.quota_unavailable_reason() or "")
    with caplog.at_level(logging.WARNING, logger="activities.storage_provider"):
        plain.create("ns-plain", 8 * MIB)
    assert "not enforced by the filesystem" in caplog.text
    (plain.namespace_dir("ns-plain") / "data.bin").write_bytes(b"x" * MIB)
    assert plain.quota_group("ns-plain") is None
    assert plain.usage_bytes("ns-plain") >= MIB
