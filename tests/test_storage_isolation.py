"""Issue 36 item 4: storage reaches only its owner. A bare-metal tenant on a node that sees the
shared export cannot walk it: it cannot list `namespaces/` or `grants/`, nor list or read another
project's namespace even knowing its id. Each namespace directory belongs to a gid of its own;
while a namespace is attached to a bare-metal allocation, the node's agent makes that
allocation's non-root tenant a member of the group, so the tenant writes its own mount and reads
it back, cannot open another project's namespace even holding a handle to it, and after the
detach can no longer write (the membership goes with the mount).

Driven as production drives it: namespaces created and attached through the tenant API (the
worker's workflows and the shared directory provider), the tenant a real non-root account made
by the agent's production bare-metal user backend (FileBaremetalUserBackend; in the end-to-end
test inside the deployed agent process, `gpucloud-agent` with the `host` backend and agent.toml's
`[storage]` table as cloud-init writes it), acted as by a subprocess that takes its uid, gid and
the supplementary groups a login would give it from the node's group file. The export and the
node's disk sit where a node has them: in directories everyone may traverse.

Not done (docs/storage.md): mounting only the attached namespaces on a node instead of the whole
export (a root tenant still reaches its node's export root).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from activities.storage_provider import SharedDirectoryProvider
from agent.backend import HostError
from agent.backends.baremetal_users import (
    STORAGE_GROUP_PREFIX,
    Account,
    FileBaremetalUserBackend,
)
from agent.backends.system_root import SystemRoot
from agent.storage_mounts import (
    TENANT_GRANT_PHASE,
    KernelBindMounter,
    MountFailed,
    StorageMountBackend,
    StorageMountConfig,
)
from contracts.host_tasks import HostErrorType, HostProvisionInput, HostReleaseInput
from contracts.storage import (
    NAMESPACE_GID_MAX,
    NAMESPACE_GID_MIN,
    PROVIDER_SHARED_DIRECTORY,
    StorageMountInput,
    StorageUnmountInput,
)
from tests.lifecycle_support import Tenant
from tests.terminal_fixtures import TerminalRig
from tests.test_agent_users import RecordingProgress
from tests.test_storage_attachments import (
    attach,
    cloud_init_storage_table,
    create_namespace,
    mounted_points,
    wait_attachment,
)

pytestmark = [
    pytest.mark.usefixtures("control_plane"),
    pytest.mark.skipif(os.geteuid() != 0, reason="acting as another uid needs root"),
]

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGpXQ0eB8l5tYTe2ycLx3JHm0h8H4dB3tj6eKpOZ1m8n p@laptop"


def traversable_directory(prefix: str) -> Path:
    """A directory under /tmp anyone may traverse, as a node's export mount and its disk are
    (pytest's own tmp_path is root-only, which would hide everything whatever the modes)."""
    top = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chmod(top, 0o755)  # noqa: S103
    return top


def unmount_under(top: Path) -> None:
    """No bind mount outlives a failed test (rmtree would walk into the namespace)."""
    for point in sorted((p for p in mounted_points() if p.startswith(f"{top}/")), reverse=True):
        with contextlib.suppress(MountFailed):
            KernelBindMounter().unmount(Path(point))


@pytest.fixture(autouse=True)
def storage_root(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The provider's root, for the worker (set before it starts) and the agents."""
    top = traversable_directory("gpucloud-export-")
    monkeypatch.setenv("GPUCLOUD_STORAGE_ROOT", str(top))
    yield top
    shutil.rmtree(top, ignore_errors=True)


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    """Where the simulated machines' disks go (terminal_rig builds its node here): traversable,
    so the tenant reaches its mount point the way it does on a node."""
    top = traversable_directory("gpucloud-node-")
    yield top
    unmount_under(top)
    shutil.rmtree(top, ignore_errors=True)


class _NoSessions:
    def terminate(self, username: str, uid: int) -> int:
        return 0


class _NoScrub:
    def scrub(self) -> str:
        return "no GPUs"


def user_backend(machine: Path) -> FileBaremetalUserBackend:
    """The production user backend on a node's disk (a copy of the account files for a node of
    our own; the CI machine's own are never edited)."""
    return FileBaremetalUserBackend(
        SystemRoot(machine), connect_host="node.test", sessions=_NoSessions(), scrubber=_NoScrub()
    )


def tenant_account(tmp_path: Path) -> Account:
    """Project P's tenant on a bare-metal node, made by the production user backend."""
    machine = tmp_path / "node"
    (machine / "etc").mkdir(parents=True)
    (machine / "home").mkdir()
    for name in ("passwd", "group", "shadow", "gshadow"):
        source = Path("/etc") / name
        if source.exists():
            shutil.copy(source, machine / "etc" / name)
    spec = HostProvisionInput(
        task_id="t-1", allocation_id="alloc-p", node_id="node-1", shape="baremetal",
        username="tenantp", ssh_public_keys=[KEY],
    )  # fmt: skip
    backend = user_backend(machine)
    backend.provision_baremetal_user(spec, RecordingProgress())
    account = backend.account("tenantp")
    assert account is not None
    assert account.uid != 0
    assert account.gid != 0
    return account


def allocation_account(machine: Path, allocation_id: str) -> Account:
    """The tenant account the node's agent made for the allocation, read from the node's passwd."""
    for line in (machine / "etc/passwd").read_text().splitlines():
        fields = line.split(":")
        if len(fields) >= 7 and fields[4] == f"gpucloud allocation {allocation_id}":
            account = user_backend(machine).account(fields[0])
            assert account is not None
            return account
    raise AssertionError(f"no account for allocation {allocation_id} on the node")


def login_groups(machine: Path, account: Account) -> list[int]:
    """The supplementary groups a login gives the tenant (initgroups: the node's group file)."""
    groups = []
    for line in (machine / "etc/group").read_text().splitlines():
        fields = line.split(":")
        if len(fields) > 3 and account.username in fields[3].split(","):
            groups.append(int(fields[2]))
    return groups


def as_tenant(
    account: Account, code: str, *, groups: list[int] | None = None, fds: tuple[int, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """`code` run by a Python that dropped to the tenant's uid, gid and `groups` (default none);
    it prints what it could do. `fds`: directory handles root opened for it."""
    return subprocess.run(
        [shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3", "-c", code],
        user=account.uid,
        group=account.gid,
        extra_groups=groups or [],
        pass_fds=fds,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def can(
    account: Account, operation: str, path: Path | int, *, groups: list[int] | None = None
) -> bool:
    """Whether the tenant may do `operation` on `path` (a path, or a directory handle of root's
    it is given: what it could do with the directory were it able to reach it)."""
    code = (
        "import os, sys\n"
        f"path = {path if isinstance(path, int) else str(path)!r}\n"
        "try:\n"
        f"    {operation}\n"
        "except (PermissionError, FileNotFoundError):\n"
        "    print('denied')\n"
        "else:\n"
        "    print('allowed')\n"
    )
    fds = (path,) if isinstance(path, int) else ()
    done = as_tenant(account, code, groups=groups, fds=fds)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip() == "allowed"


WRITE = "open(os.path.join(path, 'w.txt'), 'w').write('x')"
READ_BACK = "assert open(os.path.join(path, 'w.txt')).read() == 'x'"
LIST = "os.listdir(path)"
# Through a handle (an O_PATH one: it carries no access of root's, only the way to the directory).
LIST_AT = "os.listdir(os.open('.', os.O_RDONLY | os.O_DIRECTORY, dir_fd=path))"
WRITE_AT = "os.close(os.open('w.txt', os.O_CREAT | os.O_WRONLY, dir_fd=path))"


async def test_a_tenant_cannot_walk_the_export_into_another_projects_namespace(
    tenant: Tenant, api: Any, make_project: Any, make_token: Any, storage_root: Path,
    tmp_path: Path,
) -> None:  # fmt: skip
    other = await api(token=await make_token("tenant", await make_project()))
    mine = await create_namespace(tenant.client, "project-p-data")
    theirs = await create_namespace(other, "project-q-secrets")
    secret = storage_root / "namespaces" / theirs["id"] / "secret.txt"
    secret.write_text("project Q only\n")
    # Q's namespace granted to a node, as the storage.grant_apply activity has the provider do.
    SharedDirectoryProvider(storage_root).grant(theirs["id"], str(uuid.uuid4()), "n", "read_only")
    account = tenant_account(tmp_path)

    # Nothing of the export is listable, and another project's namespace is closed even by id.
    assert not can(account, LIST, storage_root / "namespaces")
    assert not can(account, LIST, storage_root / "grants")
    assert not can(account, LIST, storage_root / "gids")
    assert not can(account, LIST, secret.parent)
    assert not can(account, "open(path).read()", secret)
    # No world access on any namespace directory, the tenant's own included (it gets its own
    # through its attachment's mount, never through the export); each has a group of its own.
    gids = set()
    for namespace in (mine, theirs):
        st = (storage_root / "namespaces" / namespace["id"]).stat()
        assert st.st_mode & 0o7777 == 0o2770, oct(st.st_mode)
        assert NAMESPACE_GID_MIN <= st.st_gid <= NAMESPACE_GID_MAX
        gids.add(st.st_gid)
    assert len(gids) == 2


async def test_a_non_root_tenant_writes_its_own_namespace_and_nothing_else(
    terminal_rig: Callable[..., Awaitable[TerminalRig]], api: Any, make_project: Any,
    make_token: Any, storage_root: Path,
) -> None:  # fmt: skip
    rig = await terminal_rig(agent_config=cloud_init_storage_table(storage_root))
    machine = rig.agent.root
    account = allocation_account(machine, rig.allocation_id)
    mine = await create_namespace(rig.tenant, "project-p-own")
    other = await api(token=await make_token("tenant", await make_project()))
    theirs = await create_namespace(other, "project-q-private")
    own_dir = storage_root / "namespaces" / mine["id"]
    their_dir = storage_root / "namespaces" / theirs["id"]
    (their_dir / "secret.txt").write_text("project Q only\n")
    assert login_groups(machine, account) == []

    attachment = await attach(rig.tenant, rig.allocation_id, mine["id"], "single_writer")
    aid = attachment["attachment_id"]
    try:
        mounted = await wait_attachment(rig.tenant, rig.allocation_id, aid, "mounted", timeout=60)
    except AssertionError as err:
        raise AssertionError(f"{err}\nagent log:\n{rig.agent.log_tail()}") from None
    point = machine / mounted["mount_path"].lstrip("/")
    groups = login_groups(machine, account)
    assert groups == [own_dir.stat().st_gid]  # the namespace's group, and only it

    # The non-root tenant, logged in after the attach, writes its mount and reads it back; the
    # file lands in the namespace, in its group, open to the group whatever the tenant's umask.
    assert can(account, f"os.umask(0o077); {WRITE}", point, groups=groups)
    assert can(account, READ_BACK, point, groups=groups)
    written = (own_dir / "w.txt").stat()
    assert (written.st_uid, written.st_gid) == (account.uid, own_dir.stat().st_gid)
    assert written.st_mode & 0o070 == 0o060, oct(written.st_mode)
    # A login from before the attach has no access until it logs in again.
    assert not can(account, WRITE, point)

    # Project Q's namespace: not through the export, and not even with a handle to it.
    assert not can(account, LIST, storage_root / "namespaces", groups=groups)
    assert not can(account, LIST, their_dir, groups=groups)
    assert not can(account, "open(path).read()", their_dir / "secret.txt", groups=groups)
    # The same handle to its own namespace works (so the refusal below is the group's doing).
    for directory, allowed in ((own_dir, True), (their_dir, False)):
        handle = os.open(directory, os.O_PATH | os.O_DIRECTORY)
        try:
            assert can(account, LIST_AT, handle, groups=groups) is allowed, directory
            assert can(account, WRITE_AT, handle, groups=groups) is allowed, directory
        finally:
            os.close(handle)
    assert sorted(os.listdir(their_dir)) == ["secret.txt"]

    response = await rig.tenant.delete(f"/api/v1/allocations/{rig.allocation_id}/attachments/{aid}")
    assert response.status_code == 202, response.text
    await wait_attachment(rig.tenant, rig.allocation_id, aid, "detached", timeout=60)
    assert str(point) not in mounted_points()
    # Detached: the membership went with the mount, and neither a new login nor one that still
    # holds the group reaches the namespace any more.
    assert login_groups(machine, account) == []
    assert not any(
        line.startswith(STORAGE_GROUP_PREFIX)
        for line in (machine / "etc/group").read_text().splitlines()
    )
    for held in ([], groups):
        assert not can(account, WRITE, point, groups=held)
        assert not can(account, WRITE, own_dir, groups=held)
    assert (own_dir / "w.txt").read_text() == "x"  # a detach deletes nothing


def mount_input(namespace_id: str, attachment_id: str, allocation_id: str) -> StorageMountInput:
    return StorageMountInput(
        task_id="t-mount", attachment_id=attachment_id, allocation_id=allocation_id,
        node_id="node-1", provider=PROVIDER_SHARED_DIRECTORY, namespace_key=namespace_id,
        mode="single_writer", allocation_shape="baremetal",
    )  # fmt: skip


async def test_a_tampered_namespace_group_maps_the_tenant_into_nothing(
    tenant: Tenant, storage_root: Path, tmp_path: Path
) -> None:
    """A compromised node (root on the shared export) gives a namespace directory a system
    group, hoping the next node's agent puts its tenant in it: the agent maps no one, and the
    user backend refuses a gid that is not a namespace's or that a local group already holds."""
    namespace = await create_namespace(tenant.client, "tampered")
    account = tenant_account(tmp_path)
    machine = tmp_path / "node"
    users = user_backend(machine)
    directory = storage_root / "namespaces" / namespace["id"]
    aid = str(uuid.uuid4())
    SharedDirectoryProvider(storage_root).grant(namespace["id"], aid, "node-1", "single_writer")
    os.chown(directory, -1, 0)  # the tampering: after the grant, before the mount
    storage = StorageMountBackend(
        SystemRoot(machine), StorageMountConfig(export_root=storage_root), tenants=users
    )
    progress = RecordingProgress()
    outcome = storage.mount(mount_input(namespace["id"], aid, "alloc-p"), progress)
    point = machine / outcome.mount_path.lstrip("/")
    try:
        (granted,) = [m for p, s, m in progress.events if p == TENANT_GRANT_PHASE and m]
        assert "no group of its own" in granted
        assert login_groups(machine, account) == []
        assert not can(account, WRITE, point)
    finally:
        storage.unmount(
            StorageUnmountInput("t-unmount", aid, "alloc-p", "node-1", "baremetal"),
            RecordingProgress(),
        )
    assert str(point) not in mounted_points()

    for gid in (0, 27, account.gid, NAMESPACE_GID_MAX + 1):
        with pytest.raises(HostError) as refused:
            users.join_storage_group("alloc-p", gid)
        assert refused.value.error_type == HostErrorType.STORAGE_ERROR
    # A local group holding a namespace gid under another name is never joined.
    group_file = machine / "etc/group"
    group_file.write_text(group_file.read_text() + f"site-ops:x:{NAMESPACE_GID_MIN}:\n")
    with pytest.raises(HostError):
        users.join_storage_group("alloc-p", NAMESPACE_GID_MIN)
    assert login_groups(machine, account) == []


async def test_a_removed_tenant_leaves_its_storage_groups(tmp_path: Path) -> None:
    """Groups follow the members: made with the first, gone with the last; and a deprovision that
    finds a membership a failed detach left removes it and its empty group."""
    account = tenant_account(tmp_path)
    machine = tmp_path / "node"
    users = user_backend(machine)
    first, second = NAMESPACE_GID_MIN + 7, NAMESPACE_GID_MIN + 8
    assert users.join_storage_group("alloc-p", first) == account.username
    assert users.join_storage_group("alloc-p", first) == account.username  # idempotent
    assert users.join_storage_group("alloc-p", second) == account.username
    assert users.join_storage_group("alloc-other", second) is None  # no account for it here
    assert users.storage_groups(account.username) == [first, second]
    assert login_groups(machine, account) == [first, second]

    assert users.leave_storage_group("alloc-p", first) is True
    assert users.leave_storage_group("alloc-p", first) is False
    assert f"{STORAGE_GROUP_PREFIX}{first}:" not in (machine / "etc/group").read_text()

    release = HostReleaseInput(
        task_id="t-2", allocation_id="alloc-p", node_id="node-1", shape="baremetal",
        username=account.username,
    )  # fmt: skip
    users.deprovision_baremetal_user(release, RecordingProgress())
    assert STORAGE_GROUP_PREFIX not in (machine / "etc/group").read_text()
    gshadow = machine / "etc/gshadow"
    if gshadow.exists():
        assert STORAGE_GROUP_PREFIX not in gshadow.read_text()
