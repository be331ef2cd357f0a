"""FileBaremetalUserBackend against a temporary system root built per test: the CI machine's own
users are never touched. Ownership is checked where the tests run as root (chown needs it)."""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from agent.backend import (
    BAREMETAL_DEPROVISION_PHASES,
    BAREMETAL_PROVISION_PHASES,
    HostError,
    PhaseStatus,
    ReleaseOutcome,
)
from agent.backends.baremetal_users import FileBaremetalUserBackend, UserAccountConfig
from agent.backends.system_root import SystemRoot
from contracts.host_tasks import HostErrorType, HostProvisionInput, HostReleaseInput

AS_ROOT = os.geteuid() == 0
KEY_A = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKeyMaterialAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA alice@a"
KEY_B = "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQSecretishKeyBodyBBBBBBBBBBBBBBBBBBBBBBBBB alice@b"
KEY_C = "ecdsa-sha2-nistp256 AAAAE2VjZHNhLXNoYTItbmlzdHAyNTYAAAAIbmlzdHAyNTYCCCCCCCCCCCCCC c"

PASSWD = """\
root:x:0:0:root:/root:/bin/bash
daemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin
nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin
ubuntu:x:1000:1000:Ubuntu:/home/ubuntu:/bin/bash
bob:x:20000:20000:gpucloud allocation alloc-other:/home/bob:/bin/bash
"""
GROUP = """\
root:x:0:
daemon:x:1:
sudo:x:27:ubuntu
nogroup:x:65534:
ubuntu:x:1000:
bob:x:20000:
tenants:x:20001:
"""
SHADOW = """\
root:*:19000:0:99999:7:::
daemon:*:19000:0:99999:7:::
nobody:*:19000:0:99999:7:::
ubuntu:!:19000:0:99999:7:::
bob:*:19000:0:99999:7:::
"""
GSHADOW = """\
root:*::
daemon:*::
sudo:*::ubuntu
nogroup:*::
ubuntu:!::
bob:!::
tenants:!::
"""


class RecordingProgress:
    def __init__(self) -> None:
        self.events: list[tuple[str, PhaseStatus, str]] = []

    def __call__(self, phase: str, status: PhaseStatus, message: str = "") -> None:
        self.events.append((phase, status, message))

    @property
    def cancelled(self) -> bool:
        return False

    def wait(self, seconds: float | None) -> None:
        raise AssertionError("the user backend never waits")

    def suspend_heartbeats(self) -> None:
        raise AssertionError("the user backend never suspends heartbeats")

    def phases(self) -> list[tuple[str, PhaseStatus]]:
        return [(p, s) for p, s, _ in self.events]


@dataclass
class RecordingSessions:
    calls: list[tuple[str, int]] = field(default_factory=list)

    def terminate(self, username: str, uid: int) -> int:
        self.calls.append((username, uid))
        return 2


@dataclass
class RecordingScrubber:
    calls: int = 0

    def scrub(self) -> str:
        self.calls += 1
        return "GPU memory scrubbed (recorded)"


def _write(path: Path, text: str, mode: int) -> None:
    path.write_text(text)
    path.chmod(mode)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "root"
    (r / "etc/sudoers.d").mkdir(parents=True)
    (r / "etc/sudoers.d").chmod(0o750)
    _write(r / "etc/passwd", PASSWD, 0o644)
    _write(r / "etc/group", GROUP, 0o644)
    _write(r / "etc/shadow", SHADOW, 0o640)
    _write(r / "etc/gshadow", GSHADOW, 0o640)
    _write(r / "etc/.pwd.lock", "", 0o600)
    (r / "home/ubuntu").mkdir(parents=True)
    (r / "home/bob/.ssh").mkdir(parents=True)
    _write(r / "home/bob/.ssh/authorized_keys", KEY_C + "\n", 0o600)
    (r / "var/mail").mkdir(parents=True)
    return r


@dataclass
class Harness:
    backend: FileBaremetalUserBackend
    sessions: RecordingSessions
    scrubber: RecordingScrubber
    root: Path


@pytest.fixture
def harness(root: Path) -> Harness:
    sessions, scrubber = RecordingSessions(), RecordingScrubber()
    backend = FileBaremetalUserBackend(
        root, connect_host="node-1.example", sessions=sessions, scrubber=scrubber
    )
    return Harness(backend, sessions, scrubber, root)


def provision_spec(
    username: str = "alice", keys: list[str] | None = None, allocation_id: str = "alloc-1"
) -> HostProvisionInput:
    return HostProvisionInput(
        task_id="t-1",
        allocation_id=allocation_id,
        node_id="node-1",
        shape="baremetal",
        username=username,
        ssh_public_keys=[KEY_A, KEY_B] if keys is None else keys,
    )


def release_spec(username: str = "alice", allocation_id: str = "alloc-1") -> HostReleaseInput:
    return HostReleaseInput(
        task_id="t-2",
        allocation_id=allocation_id,
        node_id="node-1",
        shape="baremetal",
        username=username,
    )


def snapshot(root: Path) -> dict[str, tuple[int, int, int, str]]:
    """Every path under the root: type+mode, owner, group and content (or link target)."""
    result = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode):
            content = "-> " + os.readlink(path)
        elif stat.S_ISREG(st.st_mode):
            content = path.read_text()
        else:
            content = ""
        result[str(path.relative_to(root))] = (st.st_mode, st.st_uid, st.st_gid, content)
    return result


def line_of(root: Path, name: str, user: str) -> str | None:
    for line in (root / "etc" / name).read_text().splitlines():
        if line.split(":", 1)[0] == user:
            return line
    return None


def expected_phases(names: tuple[str, ...]) -> list[tuple[str, PhaseStatus]]:
    return [(n, s) for n in names for s in (PhaseStatus.STARTED, PhaseStatus.SUCCEEDED)]


def assert_owned(path: Path, uid: int, gid: int, mode: int) -> None:
    st = path.lstat()
    assert stat.S_IMODE(st.st_mode) == mode, f"{path}: {oct(st.st_mode)}"
    if AS_ROOT:
        assert (st.st_uid, st.st_gid) == (uid, gid), path


# ---------------------------------------------------------------------- provision


def test_provision_creates_account_home_and_keys(harness: Harness) -> None:
    progress = RecordingProgress()
    outcome = harness.backend.provision_baremetal_user(provision_spec(), progress)

    assert outcome.connect_host == "node-1.example"
    assert outcome.adopted_existing is False
    assert progress.phases() == expected_phases(BAREMETAL_PROVISION_PHASES)
    r = harness.root
    # 20000 is bob's uid and gid, 20001 is the `tenants` group: the first id free in both.
    assert line_of(r, "passwd", "alice") == (
        "alice:x:20002:20002:gpucloud allocation alloc-1:/home/alice:/bin/bash"
    )
    assert line_of(r, "group", "alice") == "alice:x:20002:"
    assert line_of(r, "gshadow", "alice") == "alice:!::"
    shadow = line_of(r, "shadow", "alice")
    assert shadow is not None
    fields = shadow.split(":")
    assert fields[1] == "*"  # no password, not locked: key login works
    assert fields[7] == ""  # not expired
    # Existing lines and file modes are untouched.
    assert (r / "etc/passwd").read_text().startswith(PASSWD)
    assert stat.S_IMODE((r / "etc/shadow").stat().st_mode) == 0o640
    assert stat.S_IMODE((r / "etc/passwd").stat().st_mode) == 0o644

    assert_owned(r / "home/alice", 20002, 20002, 0o700)
    assert_owned(r / "home/alice/.ssh", 20002, 20002, 0o700)
    assert_owned(r / "home/alice/.ssh/authorized_keys", 20002, 20002, 0o600)
    assert (r / "home/alice/.ssh/authorized_keys").read_text() == f"{KEY_A}\n{KEY_B}\n"
    assert not list((r / "etc/sudoers.d").iterdir())  # sudo is not granted by default
    account = harness.backend.account("alice")
    assert account is not None
    assert (account.uid, account.gid, account.allocation_id) == (20002, 20002, "alloc-1")


@pytest.mark.skipif(not AS_ROOT, reason="chown to the tenant's uid needs root")
def test_ownership_is_numeric_ids_of_the_new_user(harness: Harness) -> None:
    harness.backend.provision_baremetal_user(provision_spec(), RecordingProgress())
    for rel in ("home/alice", "home/alice/.ssh", "home/alice/.ssh/authorized_keys"):
        st = (harness.root / rel).lstat()
        assert (st.st_uid, st.st_gid) == (20002, 20002)
    # The account databases stay root's.
    assert (harness.root / "etc/passwd").stat().st_uid == 0


def test_provision_twice_is_the_same_state(harness: Harness) -> None:
    harness.backend.provision_baremetal_user(provision_spec(), RecordingProgress())
    first = snapshot(harness.root)
    progress = RecordingProgress()
    outcome = harness.backend.provision_baremetal_user(provision_spec(), progress)
    assert outcome.adopted_existing is True
    assert progress.phases() == expected_phases(BAREMETAL_PROVISION_PHASES)
    assert "adopted" in progress.events[1][2]
    assert snapshot(harness.root) == first


def test_existing_user_gets_the_specs_keys(harness: Harness) -> None:
    harness.backend.provision_baremetal_user(provision_spec(keys=[KEY_A]), RecordingProgress())
    # A tenant file in the home survives a re-provision.
    (harness.root / "home/alice/work.txt").write_text("results")
    outcome = harness.backend.provision_baremetal_user(
        provision_spec(keys=[KEY_C]), RecordingProgress()
    )
    assert outcome.adopted_existing is True
    assert (harness.root / "home/alice/.ssh/authorized_keys").read_text() == KEY_C + "\n"
    assert (harness.root / "home/alice/work.txt").read_text() == "results"
    assert line_of(harness.root, "passwd", "alice") is not None
    assert (harness.root / "etc/passwd").read_text().count("\nalice:") == 1


def test_ssh_dir_symlink_is_replaced_not_followed(harness: Harness, tmp_path: Path) -> None:
    harness.backend.provision_baremetal_user(provision_spec(), RecordingProgress())
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "authorized_keys").write_text("untouched\n")
    ssh = harness.root / "home/alice/.ssh"
    (ssh / "authorized_keys").unlink()
    ssh.rmdir()
    ssh.symlink_to(outside)  # what a tenant could plant in its own home

    harness.backend.provision_baremetal_user(provision_spec(keys=[KEY_C]), RecordingProgress())

    assert (outside / "authorized_keys").read_text() == "untouched\n"
    assert not ssh.is_symlink()
    assert (ssh / "authorized_keys").read_text() == KEY_C + "\n"


def test_ids_skip_used_uids_and_gids_and_stay_in_range(root: Path) -> None:
    backend = FileBaremetalUserBackend(
        root,
        connect_host="n",
        sessions=RecordingSessions(),
        scrubber=RecordingScrubber(),
        config=UserAccountConfig(uid_min=20000, uid_max=20003),
    )
    backend.provision_baremetal_user(provision_spec("alice"), RecordingProgress())
    backend.provision_baremetal_user(
        provision_spec("carol", allocation_id="alloc-2"), RecordingProgress()
    )
    assert line_of(root, "passwd", "alice").split(":")[2:4] == ["20002", "20002"]  # type: ignore[union-attr]
    assert line_of(root, "passwd", "carol").split(":")[2:4] == ["20003", "20003"]  # type: ignore[union-attr]
    with pytest.raises(HostError) as err:
        backend.provision_baremetal_user(
            provision_spec("dave", allocation_id="alloc-3"), RecordingProgress()
        )
    assert err.value.error_type is HostErrorType.LEASE_CONFLICT
    assert line_of(root, "passwd", "dave") is None


def test_sudo_grant_when_configured(root: Path) -> None:
    before = snapshot(root)
    backend = FileBaremetalUserBackend(
        root,
        connect_host="n",
        sessions=RecordingSessions(),
        scrubber=RecordingScrubber(),
        config=UserAccountConfig(grant_sudo=True),
    )
    backend.provision_baremetal_user(provision_spec(), RecordingProgress())
    sudoers = root / "etc/sudoers.d/gpucloud-alice"
    assert sudoers.read_text() == "alice ALL=(ALL) NOPASSWD:ALL\n"
    assert_owned(sudoers, 0, 0, 0o440)
    backend.deprovision_baremetal_user(release_spec(), RecordingProgress())
    assert snapshot(root) == before


# ---------------------------------------------------------------------- revoke


def test_revoke_disables_login_and_keeps_home(harness: Harness) -> None:
    harness.backend.provision_baremetal_user(provision_spec(), RecordingProgress())
    (harness.root / "home/alice/work.txt").write_text("results")

    outcome = harness.backend.revoke_user("alice", "alloc-1")

    assert outcome.existed is True
    assert outcome.sessions_terminated == 2
    assert harness.sessions.calls == [("alice", 20002)]
    r = harness.root
    passwd = line_of(r, "passwd", "alice")
    assert passwd is not None
    assert passwd.endswith(":/usr/sbin/nologin")
    shadow = line_of(r, "shadow", "alice")
    assert shadow is not None
    assert shadow.split(":")[1].startswith("!")
    assert shadow.split(":")[7] == "1"
    assert not (r / "home/alice/.ssh/authorized_keys").exists()
    assert (r / "home/alice/work.txt").read_text() == "results"
    assert harness.scrubber.calls == 0

    revoked = snapshot(r)
    assert harness.backend.revoke_user("alice").existed is True  # idempotent
    assert snapshot(r) == revoked
    assert harness.backend.revoke_user("zed").existed is False

    # A new provision of the same allocation re-enables the account.
    outcome2 = harness.backend.provision_baremetal_user(provision_spec(), RecordingProgress())
    assert outcome2.adopted_existing is True
    assert line_of(r, "passwd", "alice").endswith(":/bin/bash")  # type: ignore[union-attr]
    shadow = line_of(r, "shadow", "alice")
    assert shadow is not None
    assert shadow.split(":")[1] == "*"
    assert shadow.split(":")[7] == ""


def test_revoke_refuses_system_accounts(harness: Harness) -> None:
    before = snapshot(harness.root)
    with pytest.raises(HostError) as err:
        harness.backend.revoke_user("ubuntu")
    assert err.value.error_type is HostErrorType.INVALID_SPEC
    assert snapshot(harness.root) == before
    assert harness.sessions.calls == []


# ---------------------------------------------------------------------- deprovision


def test_deprovision_leaves_no_trace(harness: Harness) -> None:
    before = snapshot(harness.root)
    harness.backend.provision_baremetal_user(provision_spec(), RecordingProgress())
    home = harness.root / "home/alice"
    (home / "data").mkdir()
    (home / "data/model.bin").write_bytes(b"\0" * 1024)
    (home / "link-to-etc").symlink_to(harness.root / "etc")  # never followed by the wipe
    (harness.root / "var/mail/alice").write_text("mail")
    assert snapshot(harness.root) != before

    progress = RecordingProgress()
    outcome = harness.backend.deprovision_baremetal_user(release_spec(), progress)

    assert outcome == ReleaseOutcome(
        released=True, hard_stopped=False, wiped=True, leases_released=True
    )
    assert progress.phases() == expected_phases(BAREMETAL_DEPROVISION_PHASES)
    assert harness.sessions.calls == [("alice", 20002)]
    assert harness.scrubber.calls == 1
    assert snapshot(harness.root) == before
    assert harness.backend.account("alice") is None


def test_deprovision_of_a_user_already_gone_succeeds_and_still_scrubs(harness: Harness) -> None:
    before = snapshot(harness.root)
    progress = RecordingProgress()
    outcome = harness.backend.deprovision_baremetal_user(release_spec(), progress)
    assert outcome.released
    assert outcome.wiped
    assert progress.phases() == expected_phases(BAREMETAL_DEPROVISION_PHASES)
    assert "already" in progress.events[1][2]
    assert harness.sessions.calls == []
    assert harness.scrubber.calls == 1
    assert snapshot(harness.root) == before


def test_deprovision_after_partial_earlier_attempt(harness: Harness) -> None:
    """A crash after user_removed left the home behind: the re-run wipes it."""
    before = snapshot(harness.root)
    harness.backend.provision_baremetal_user(provision_spec(), RecordingProgress())
    passwd = (harness.root / "etc/passwd").read_text()
    (harness.root / "etc/passwd").write_text(
        "".join(line + "\n" for line in passwd.splitlines() if not line.startswith("alice:"))
    )
    harness.backend.deprovision_baremetal_user(release_spec(), RecordingProgress())
    assert snapshot(harness.root) == before


def test_another_allocations_user_is_a_lease_conflict(harness: Harness) -> None:
    before = snapshot(harness.root)
    with pytest.raises(HostError) as err:
        harness.backend.provision_baremetal_user(provision_spec("bob"), RecordingProgress())
    assert err.value.error_type is HostErrorType.LEASE_CONFLICT
    with pytest.raises(HostError) as err:
        harness.backend.deprovision_baremetal_user(release_spec("bob"), RecordingProgress())
    assert err.value.error_type is HostErrorType.LEASE_CONFLICT
    assert snapshot(harness.root) == before
    assert harness.scrubber.calls == 0


# ---------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "username",
    ["", "Alice", "1alice", "al ice", "../etc", "alice:x", "a" * 33, "root", "daemon", "ubuntu"],
)
def test_invalid_or_system_usernames_are_invalid_spec(harness: Harness, username: str) -> None:
    before = snapshot(harness.root)
    with pytest.raises(HostError) as err:
        harness.backend.provision_baremetal_user(provision_spec(username), RecordingProgress())
    assert err.value.error_type is HostErrorType.INVALID_SPEC
    with pytest.raises(HostError) as err:
        harness.backend.deprovision_baremetal_user(release_spec(username), RecordingProgress())
    assert err.value.error_type is HostErrorType.INVALID_SPEC
    assert snapshot(harness.root) == before
    assert harness.sessions.calls == []
    assert harness.scrubber.calls == 0


def test_multiline_key_is_invalid_spec_without_quoting_it(harness: Harness) -> None:
    bad = KEY_A + "\nssh-ed25519 AAAAinjected"
    with pytest.raises(HostError) as err:
        harness.backend.provision_baremetal_user(
            provision_spec(keys=[KEY_B, bad]), RecordingProgress()
        )
    assert err.value.error_type is HostErrorType.INVALID_SPEC
    assert "ssh_public_keys[1]" in err.value.message
    assert "AAAA" not in err.value.message
    assert line_of(harness.root, "passwd", "alice") is None


def test_slice_methods_are_invalid_spec(harness: Harness) -> None:
    with pytest.raises(HostError) as err:
        harness.backend.provision_slice_vm(provision_spec(), RecordingProgress())
    assert err.value.error_type is HostErrorType.INVALID_SPEC
    with pytest.raises(HostError) as err:
        harness.backend.release_slice_vm(release_spec(), RecordingProgress())
    assert err.value.error_type is HostErrorType.INVALID_SPEC


def test_key_material_never_logged_or_reported(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    progress = RecordingProgress()
    harness.backend.provision_baremetal_user(provision_spec(), progress)
    harness.backend.provision_baremetal_user(provision_spec(keys=[KEY_C]), progress)
    harness.backend.revoke_user("alice")
    harness.backend.deprovision_baremetal_user(release_spec(), progress)
    assert caplog.records  # the backend does log, just never keys
    reported = caplog.text + "\n".join(message for _, _, message in progress.events)
    for key in (KEY_A, KEY_B, KEY_C):
        body = key.split()[1]
        assert body not in reported
        assert body[-20:] not in reported


def test_system_root_refuses_paths_leaving_it(root: Path) -> None:
    sr = SystemRoot(root)
    with pytest.raises(ValueError, match="leaves"):
        sr.host_path("/home/../../etc/passwd")
    assert sr.host_path("/etc/passwd") == root.resolve() / "etc/passwd"


async def test_backend_runs_behind_the_host_activities(harness: Harness) -> None:
    """The backend plugs into HostActivities: phases reach the result, a HostError becomes an
    ApplicationError of its type (run in temporalio's ActivityEnvironment, no server needed)."""
    from temporalio.exceptions import ApplicationError
    from temporalio.testing import ActivityEnvironment

    from agent.host_activities import HostActivities

    activities = HostActivities(harness.backend, node_id="node-1")
    env = ActivityEnvironment()
    result = await env.run(activities.provision_baremetal_user, provision_spec())
    assert [(p.phase, p.status) for p in result.phases] == expected_phases(
        BAREMETAL_PROVISION_PHASES
    )
    assert result.connect_host == "node-1.example"
    released = await env.run(activities.deprovision_baremetal_user, release_spec())
    assert released.cleanup_proven
    with pytest.raises(ApplicationError) as err:
        await env.run(activities.provision_baremetal_user, provision_spec("bob"))
    assert err.value.type == HostErrorType.LEASE_CONFLICT.value


def test_revoke_activity_path_disables_login_and_keeps_home(harness: Harness) -> None:
    """allocation.revoke_user on this backend: the phases, and the account and home kept."""
    from agent.backend import BAREMETAL_REVOKE_PHASES

    harness.backend.provision_baremetal_user(provision_spec(), RecordingProgress())
    progress = RecordingProgress()
    outcome = harness.backend.revoke_baremetal_user(release_spec(), progress)
    assert outcome.revoked is True
    assert [p for p, s in progress.phases() if s == PhaseStatus.SUCCEEDED] == list(
        BAREMETAL_REVOKE_PHASES
    )
    assert (harness.root / "home/alice").is_dir()
    assert not (harness.root / "home/alice/.ssh/authorized_keys").exists()
    assert line_of(harness.root, "passwd", "alice") is not None
