"""Bare-metal tenant access: the tenant's user account and SSH keys on a whole node.

`FileBaremetalUserBackend` implements the bare-metal half of `agent.backend.HostBackend`
(allocation.provision_user / allocation.deprovision_user) plus `revoke_user` (allocation.revoke_user
in docs/lifecycles/allocation.md: login disabled, keys removed, home kept). It edits the account
databases itself — etc/passwd, etc/group, etc/shadow, etc/gshadow,
home/<user>/.ssh/authorized_keys, etc/sudoers.d/ — under a `SystemRoot`, a directory standing for
"/". Tests point it at a temporary tree, so they never touch the CI machine's own users.

Production seam: on a node the root is "/" and this file-based variant works as it is (it takes
the same `etc/.pwd.lock` shadow-utils takes), but a node that uses nscd/sssd, SELinux labels or
distribution hooks should get a variant that runs useradd/usermod/userdel/chpasswd instead of
editing the files; it would subclass this one and override `_create_account`/`_delete_account`
(the only two methods that write the account databases), keeping the phases, validation,
adoption rules, the SSH-key writing and the home wipe. Two more seams are protocols:
`SessionTerminator` (production: `loginctl terminate-user` then SIGKILL to every process of the
uid) and `GpuScrubber` (production: the vendor's scrub, e.g. an nvidia-smi reset or a memory-
clearing job). Neither is implemented here: the agent wires real ones in; tests record calls.

Rules kept from the simulator (sim/host.py): a provision re-run adopts the user an earlier attempt
created (same state, keys replaced by the spec's), a deprovision of a user already gone succeeds,
and every deprovision ends with the GPU scrub. Only accounts in the managed uid range are ever
adopted, revoked or removed: a spec naming `root` or any pre-existing system account is
`invalid_spec`, and one naming another allocation's user is `lease_conflict`.

Storage: while a storage namespace is mounted for an allocation (agent/storage_mounts.py), its
tenant account is a member of the namespace's group (`gpucloud-ns<gid>`, the gid the storage
provider gave the namespace, in contracts.storage's NAMESPACE_GID range): `join_storage_group` and
`leave_storage_group`. The group is made with its first member and removed with its last, and a
removed account leaves every group.

Key material is never logged, put in messages or errors: only counts.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from agent.backend import (
    BAREMETAL_DEPROVISION_PHASES,
    BAREMETAL_PROVISION_PHASES,
    HostError,
    PhaseStatus,
    Progress,
    ProvisionOutcome,
    ReleaseOutcome,
)
from agent.backend import RevokeOutcome as HostRevokeOutcome
from agent.backends.system_root import SystemRoot
from contracts.host_tasks import HostErrorType, HostProvisionInput, HostReleaseInput
from contracts.storage import NAMESPACE_GID_MAX, NAMESPACE_GID_MIN

logger = logging.getLogger("agent.backends.baremetal_users")

# POSIX-portable user names, as useradd accepts them by default (agent/validation.py agrees).
USERNAME_PATTERN = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
# Names never handed to a tenant, even if no such account exists on this node yet.
RESERVED_USERNAMES = frozenset(
    {
        "root", "daemon", "bin", "sys", "sync", "games", "man", "lp", "mail", "news", "uucp",
        "proxy", "www-data", "backup", "list", "irc", "gnats", "nobody", "systemd-network",
        "systemd-resolve", "messagebus", "sshd", "syslog", "admin", "ubuntu", "debian",
        "postgres", "libvirt-qemu", "nvidia-persistenced", "gpucloud", "maas",
    }
)  # fmt: skip
_ALLOCATION_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_GECOS_TAG = "gpucloud allocation "
STORAGE_GROUP_PREFIX = "gpucloud-ns"

_PROVISION_USER, _INSTALL_KEYS, _VERIFY = BAREMETAL_PROVISION_PHASES
_TERMINATE, _REMOVE_USER, _WIPE_HOME, _SCRUB = BAREMETAL_DEPROVISION_PHASES


class SessionTerminator(Protocol):
    """Ends every login session and process of a user (production: loginctl terminate-user, then
    SIGKILL to what is left of the uid). Blocks until they are gone; raises if they are not."""

    def terminate(self, username: str, uid: int) -> int:
        """Returns how many sessions/processes were ended."""
        ...


class GpuScrubber(Protocol):
    """Clears every GPU's memory on this node after a tenant leaves (vendor command behind it).
    Raises if the scrub failed; returns a short message with no tenant data in it."""

    def scrub(self) -> str: ...


@dataclass(frozen=True)
class UserAccountConfig:
    uid_min: int = 20000
    uid_max: int = 29999
    home_base: str = "/home"
    login_shell: str = "/bin/bash"
    nologin_shell: str = "/usr/sbin/nologin"
    # A whole-node tenant may get passwordless sudo through etc/sudoers.d/gpucloud-<user>.
    grant_sudo: bool = False
    sudoers_prefix: str = "gpucloud-"

    def __post_init__(self) -> None:
        if not 0 < self.uid_min <= self.uid_max:
            raise ValueError("uid range must be positive and non-empty")
        if self.uid_min <= NAMESPACE_GID_MAX and self.uid_max >= NAMESPACE_GID_MIN:
            raise ValueError("the uid range overlaps the storage namespaces' gids")


@dataclass(frozen=True)
class Account:
    username: str
    uid: int
    gid: int
    home: str
    allocation_id: str
    # The passwd login shell (the nologin shell once revoked); "" where not read from passwd.
    shell: str = ""


@dataclass(frozen=True)
class RevokeOutcome:
    existed: bool
    sessions_terminated: int


class _Table:
    """One colon-separated account database (passwd, group, shadow, gshadow), edited in memory;
    lines this code does not own (comments, NIS `+` entries, other users) are kept verbatim."""

    def __init__(self, root: SystemRoot, path: str, *, required: bool) -> None:
        self.path = path
        text = root.read_text(path)
        if text is None and required:
            raise FileNotFoundError(f"{path} is missing under the system root")
        self.exists = text is not None
        self._original = text or ""
        self.lines = self._original.splitlines()

    def rows(self) -> list[list[str]]:
        return [line.split(":") for line in self.lines if line and line[0] not in "#+-"]

    def find(self, name: str) -> list[str] | None:
        for row in self.rows():
            if row[0] == name:
                return row
        return None

    def put(self, fields: list[str]) -> None:
        line = ":".join(fields)
        for i, existing in enumerate(self.lines):
            if existing.split(":", 1)[0] == fields[0]:
                self.lines[i] = line
                return
        self.lines.append(line)

    def remove(self, name: str) -> bool:
        kept = [line for line in self.lines if line.split(":", 1)[0] != name]
        removed = len(kept) != len(self.lines)
        self.lines = kept
        return removed

    def drop_member(self, name: str, *columns: int) -> None:
        """Remove `name` from comma-separated member lists (group/gshadow supplementary members)."""
        for i, line in enumerate(self.lines):
            if not line or line[0] in "#+-":
                continue
            row = line.split(":")
            for column in columns:
                if column < len(row) and name in row[column].split(","):
                    row[column] = ",".join(m for m in row[column].split(",") if m != name)
            self.lines[i] = ":".join(row)

    def save(self, root: SystemRoot) -> None:
        if not self.exists:
            return
        text = "".join(line + "\n" for line in self.lines)
        if text != self._original:
            root.write_atomic(self.path, text)  # mode and owner of the existing file kept
            self._original = text


class _Accounts:
    def __init__(self, root: SystemRoot) -> None:
        self.passwd = _Table(root, "/etc/passwd", required=True)
        self.group = _Table(root, "/etc/group", required=True)
        self.shadow = _Table(root, "/etc/shadow", required=False)
        self.gshadow = _Table(root, "/etc/gshadow", required=False)

    def save(self, root: SystemRoot) -> None:
        # Groups before users, like useradd: a crash in between leaves a group a re-run reuses.
        for table in (self.group, self.gshadow, self.passwd, self.shadow):
            table.save(root)


class FileBaremetalUserBackend:
    """Bare-metal tenant users by editing the account files under `root` (see the module text
    for the production seam). `connect_host`: what the tenant SSHes to (this node's address)."""

    def __init__(
        self,
        root: SystemRoot | Path | str,
        *,
        connect_host: str,
        sessions: SessionTerminator,
        scrubber: GpuScrubber,
        config: UserAccountConfig | None = None,
    ) -> None:
        self.root = root if isinstance(root, SystemRoot) else SystemRoot(root)
        self.connect_host = connect_host
        self.sessions = sessions
        self.scrubber = scrubber
        self.config = config or UserAccountConfig()

    # ------------------------------------------------------------------ HostBackend

    def provision_slice_vm(self, spec: HostProvisionInput, progress: Progress) -> ProvisionOutcome:
        raise HostError(HostErrorType.INVALID_SPEC, "this backend serves bare-metal nodes only")

    def release_slice_vm(self, spec: HostReleaseInput, progress: Progress) -> ReleaseOutcome:
        raise HostError(HostErrorType.INVALID_SPEC, "this backend serves bare-metal nodes only")

    def provision_baremetal_user(
        self, spec: HostProvisionInput, progress: Progress
    ) -> ProvisionOutcome:
        self._check_username(spec.username)
        self._check_allocation_id(spec.allocation_id)
        keys = self._checked_keys(spec.ssh_public_keys)
        adopted = False
        account: Account | None = None

        def create_user() -> str:
            nonlocal adopted, account
            account, adopted = self._create_account(spec.username, spec.allocation_id)
            self.root.ensure_dir(
                self._home(spec.username), mode=0o700, uid=account.uid, gid=account.gid
            )
            if adopted:
                return f"adopted existing user {account.username} (uid {account.uid})"
            return f"user {account.username} created (uid {account.uid})"

        def install_keys() -> str:
            assert account is not None
            self._install_keys(account, keys)
            self._write_sudoers(account.username, grant=self.config.grant_sudo)
            return f"{len(keys)} authorized key(s) installed"

        def verify_access() -> str:
            assert account is not None
            self._verify_access(account, keys)
            return f"login for {account.username} verified on {self.connect_host}"

        _phase(progress, _PROVISION_USER, create_user)
        _phase(progress, _INSTALL_KEYS, install_keys)
        _phase(progress, _VERIFY, verify_access)
        logger.info(
            "allocation %s: user %s ready (adopted=%s)", spec.allocation_id, spec.username, adopted
        )
        return ProvisionOutcome(connect_host=self.connect_host, adopted_existing=adopted)

    def deprovision_baremetal_user(
        self, spec: HostReleaseInput, progress: Progress
    ) -> ReleaseOutcome:
        self._check_username(spec.username)
        self._check_allocation_id(spec.allocation_id)

        def terminate_sessions() -> str:
            revoked = self._revoke(spec.username, spec.allocation_id)
            if not revoked.existed:
                return "no user (already removed)"
            return f"login disabled, {revoked.sessions_terminated} session(s) terminated"

        def remove_user() -> str:
            removed = self._delete_account(spec.username, spec.allocation_id)
            self._write_sudoers(spec.username, grant=False)
            return f"user {spec.username} removed" if removed else "already removed"

        def wipe_home() -> str:
            wiped = self.root.remove_tree(self._home(spec.username))
            for spool in (
                f"/var/mail/{spec.username}",
                f"/var/spool/cron/crontabs/{spec.username}",
            ):
                self.root.remove_file(spool)
            return "home directory wiped" if wiped else "no home directory (already wiped)"

        _phase(progress, _TERMINATE, terminate_sessions)
        _phase(progress, _REMOVE_USER, remove_user)
        _phase(progress, _WIPE_HOME, wipe_home)
        _phase(progress, _SCRUB, self.scrubber.scrub)
        logger.info("allocation %s: user %s deprovisioned", spec.allocation_id, spec.username)
        return ReleaseOutcome(released=True, hard_stopped=False, wiped=True, leases_released=True)

    # ------------------------------------------------------------------ revoke

    def revoke_baremetal_user(
        self, spec: HostReleaseInput, progress: Progress
    ) -> HostRevokeOutcome:
        """The allocation.revoke_user activity: revoke_user, reported in phases."""
        outcome: RevokeOutcome | None = None

        def revoke() -> str:
            nonlocal outcome
            outcome = self.revoke_user(spec.username, spec.allocation_id)
            return "login disabled, keys removed" if outcome.existed else "no such user"

        _phase(progress, "login_disabled", revoke)
        _phase(
            progress,
            "sessions_terminated",
            lambda: f"{outcome.sessions_terminated if outcome else 0} session(s) terminated",
        )
        assert outcome is not None
        return HostRevokeOutcome(
            revoked=outcome.existed, sessions_terminated=outcome.sessions_terminated
        )

    def revoke_user(self, username: str, allocation_id: str | None = None) -> RevokeOutcome:
        """Disable login (shadow locked and expired, shell nologin), remove authorized_keys and
        any sudoers grant, end running sessions; the account and home stay. Idempotent. With
        `allocation_id`, a user belonging to another allocation is a lease_conflict."""
        self._check_username(username)
        if allocation_id is not None:
            self._check_allocation_id(allocation_id)
        outcome = self._revoke(username, allocation_id)
        logger.info("user %s revoked (existed=%s)", username, outcome.existed)
        return outcome

    def account(self, username: str) -> Account | None:
        """The managed account of this name, if any (read-only)."""
        self._check_username(username)
        with self.root.account_lock():
            accounts = _Accounts(self.root)
            row = accounts.passwd.find(username)
            return None if row is None else self._managed(row, None)

    # ------------------------------------------------------------------ storage groups

    def join_storage_group(self, allocation_id: str, gid: int) -> str | None:
        """Make the allocation's tenant a member of the storage namespace group `gid` (made if
        missing). Returns the user name, or None when this node has no account for the
        allocation. Idempotent. A gid outside the namespaces' range, or held here by a group
        that is not a namespace's, is refused: the gid comes from the shared filesystem, and no
        tenant is ever put in a system group that way."""
        self._check_allocation_id(allocation_id)
        name = _storage_group_name(gid)
        with self.root.account_lock():
            db = _Accounts(self.root)
            account = self._allocation_account(db, allocation_id)
            if account is None:
                return None
            for row in db.group.rows():
                if len(row) > 2 and row[2] == str(gid) and row[0] != name:
                    raise HostError(
                        HostErrorType.STORAGE_ERROR,
                        f"gid {gid} is held by another group on this node",
                    )
            members = _members(db.group.find(name), 3)
            if account.username not in members:
                members.append(account.username)
            db.group.put([name, "x", str(gid), ",".join(members)])
            if db.gshadow.exists:
                db.gshadow.put([name, "!", "", ",".join(members)])
            db.save(self.root)
        return account.username

    def leave_storage_group(self, allocation_id: str, gid: int) -> bool:
        """Take the allocation's tenant out of the storage namespace group `gid`; the group goes
        with its last member. Returns whether it was a member. Idempotent."""
        self._check_allocation_id(allocation_id)
        name = _storage_group_name(gid)
        with self.root.account_lock():
            db = _Accounts(self.root)
            account = self._allocation_account(db, allocation_id)
            group = db.group.find(name)
            if account is None or group is None:
                return False
            members = _members(group, 3)
            was_member = account.username in members
            members = [m for m in members if m != account.username]
            if members:
                db.group.put([name, "x", str(gid), ",".join(members)])
                if db.gshadow.exists:
                    db.gshadow.put([name, "!", "", ",".join(members)])
            else:
                db.group.remove(name)
                db.gshadow.remove(name)
            db.save(self.root)
        return was_member

    def storage_groups(self, username: str) -> list[int]:
        """The namespace gids `username` is a member of (read-only)."""
        self._check_username(username)
        with self.root.account_lock():
            db = _Accounts(self.root)
            return sorted(
                int(row[2])
                for row in db.group.rows()
                if row[0].startswith(STORAGE_GROUP_PREFIX)
                and len(row) > 3
                and row[2].isdigit()
                and username in _members(row, 3)
            )

    def _allocation_account(self, db: _Accounts, allocation_id: str) -> Account | None:
        tag = _GECOS_TAG + allocation_id
        for row in db.passwd.rows():
            if len(row) >= 7 and row[4] == tag and self._in_range(row[2]):
                return self._managed(row, allocation_id)
        return None

    # ------------------------------------------------------------------ account databases

    def _create_account(self, username: str, allocation_id: str) -> tuple[Account, bool]:
        """Create (or adopt and repair) the user, its private group and their shadow entries;
        re-enable a revoked login. Returns the account and whether it existed already."""
        cfg = self.config
        with self.root.account_lock():
            db = _Accounts(self.root)
            row = db.passwd.find(username)
            adopted = row is not None
            if row is not None:
                existing = self._managed(row, allocation_id)
                uid, gid = existing.uid, existing.gid
            else:
                uid, gid = self._allocate_ids(db, username)
            home = self._home(username)
            gecos = _GECOS_TAG + allocation_id
            db.passwd.put([username, "x", str(uid), str(gid), gecos, home, cfg.login_shell])
            group = db.group.find(username)
            members = group[3] if group is not None and len(group) > 3 else ""
            db.group.put([username, "x", str(gid), members])
            if db.gshadow.exists and db.gshadow.find(username) is None:
                db.gshadow.put([username, "!", "", ""])
            if db.shadow.exists:
                shadow = db.shadow.find(username)
                if shadow is None:
                    # "*": no password can ever match, but the account is not locked, so SSH
                    # public-key login works with and without PAM.
                    days = str(int(time.time() // 86400))
                    shadow = [username, "*", days, "0", "99999", "7", "", "", ""]
                shadow = (shadow + [""] * 9)[:9]
                shadow[1] = shadow[1].lstrip("!") or "*"  # undo a revoke's lock
                shadow[7] = ""  # and its expiry
                db.shadow.put(shadow)
            db.save(self.root)
        return Account(username, uid, gid, home, allocation_id), adopted

    def _delete_account(self, username: str, allocation_id: str) -> bool:
        with self.root.account_lock():
            db = _Accounts(self.root)
            row = db.passwd.find(username)
            gid: int | None = None
            if row is not None:
                gid = self._managed(row, allocation_id).gid
            group = db.group.find(username)
            if group is not None and gid is None:
                # A group left by a crashed create or delete: only ours if in the managed range.
                gid = int(group[2]) if self._in_range(group[2]) else None
            removed = db.passwd.remove(username)
            db.shadow.remove(username)
            if group is not None and gid is not None and group[2] == str(gid):
                removed = db.group.remove(username) or removed
                db.gshadow.remove(username)
            db.group.drop_member(username, 3)
            db.gshadow.drop_member(username, 2, 3)
            for row in db.group.rows():
                # Storage groups left with no member (a detach that never ran) go too.
                if row[0].startswith(STORAGE_GROUP_PREFIX) and not _members(row, 3):
                    db.group.remove(row[0])
                    db.gshadow.remove(row[0])
            db.save(self.root)
        return removed

    def _revoke(self, username: str, allocation_id: str | None) -> RevokeOutcome:
        with self.root.account_lock():
            db = _Accounts(self.root)
            row = db.passwd.find(username)
            if row is None:
                return RevokeOutcome(existed=False, sessions_terminated=0)
            account = self._managed(row, allocation_id)
            row = (row + [""] * 7)[:7]
            row[6] = self.config.nologin_shell
            db.passwd.put(row)
            shadow = db.shadow.find(username)
            if shadow is not None:
                shadow = (shadow + [""] * 9)[:9]
                if not shadow[1].startswith("!"):
                    shadow[1] = "!" + shadow[1]
                shadow[7] = "1"  # expired on 1970-01-02: PAM and sshd refuse every method
                db.shadow.put(shadow)
            db.save(self.root)
        self.root.remove_file(f"{account.home}/.ssh/authorized_keys")
        self._write_sudoers(username, grant=False)
        ended = self.sessions.terminate(username, account.uid)
        return RevokeOutcome(existed=True, sessions_terminated=ended)

    def _allocate_ids(self, db: _Accounts, username: str) -> tuple[int, int]:
        cfg = self.config
        used_uids = {int(r[2]) for r in db.passwd.rows() if len(r) > 2 and r[2].isdigit()}
        used_gids = {int(r[2]) for r in db.group.rows() if len(r) > 2 and r[2].isdigit()}
        group = db.group.find(username)
        if group is not None:
            # A group an interrupted earlier attempt created: reuse it if it is ours.
            if not self._in_range(group[2]):
                raise HostError(
                    HostErrorType.INVALID_SPEC,
                    f"a group named {username} exists outside the managed id range",
                )
            gid = int(group[2])
            if gid not in used_uids:
                return gid, gid
            for uid in range(cfg.uid_min, cfg.uid_max + 1):
                if uid not in used_uids:
                    return uid, gid
        else:
            for uid in range(cfg.uid_min, cfg.uid_max + 1):
                if uid not in used_uids and uid not in used_gids:
                    return uid, uid
        raise HostError(HostErrorType.LEASE_CONFLICT, "no free uid/gid left in the managed range")

    def _managed(self, row: list[str], allocation_id: str | None) -> Account:
        """The account of a passwd row, refusing ones this agent must not touch."""
        username = row[0]
        if len(row) < 7 or not self._in_range(row[2]) or not row[3].isdigit():
            raise HostError(
                HostErrorType.INVALID_SPEC,
                f"user {username} exists and is not an account this agent manages",
            )
        owner = row[4][len(_GECOS_TAG) :] if row[4].startswith(_GECOS_TAG) else None
        if allocation_id is not None and owner is not None and owner != allocation_id:
            raise HostError(
                HostErrorType.LEASE_CONFLICT, f"user {username} belongs to another allocation"
            )
        home = self._home(username)
        return Account(username, int(row[2]), int(row[3]), home, owner or "", shell=row[6])

    def _in_range(self, value: str) -> bool:
        return value.isdigit() and self.config.uid_min <= int(value) <= self.config.uid_max

    # ------------------------------------------------------------------ files in the home

    def _home(self, username: str) -> str:
        # Always derived from the configuration, never read back from passwd, so an edited
        # passwd line cannot point the wipe at another directory.
        return f"{self.config.home_base.rstrip('/')}/{username}"

    def _install_keys(self, account: Account, keys: list[str]) -> None:
        ssh_dir = f"{account.home}/.ssh"
        self.root.ensure_dir(account.home, mode=0o700, uid=account.uid, gid=account.gid)
        self.root.ensure_dir(ssh_dir, mode=0o700, uid=account.uid, gid=account.gid)
        self.root.write_atomic(
            f"{ssh_dir}/authorized_keys",
            "".join(key + "\n" for key in keys),
            mode=0o600,
            uid=account.uid,
            gid=account.gid,
        )

    def _write_sudoers(self, username: str, *, grant: bool) -> None:
        path = f"/etc/sudoers.d/{self.config.sudoers_prefix}{username}"
        if not grant:
            self.root.remove_file(path)
            return
        self.root.ensure_dir("/etc/sudoers.d", mode=0o750, uid=0, gid=0)
        self.root.write_atomic(
            path, f"{username} ALL=(ALL) NOPASSWD:ALL\n", mode=0o440, uid=0, gid=0
        )

    def _verify_access(self, account: Account, keys: list[str]) -> None:
        """Read back what sshd will read: an unlocked account with a login shell, and exactly
        these keys in a 0600 file under a 0700 .ssh, both owned by the user."""
        with self.root.account_lock():
            db = _Accounts(self.root)
            row = db.passwd.find(account.username)
            shadow = db.shadow.find(account.username)
        problems = []
        if row is None or row[6:7] != [self.config.login_shell] or row[2] != str(account.uid):
            problems.append("passwd entry")
        if db.shadow.exists and (
            shadow is None or shadow[1].startswith("!") or shadow[7:8] != [""]
        ):
            problems.append("shadow entry (locked or expired)")
        checks = (
            (account.home, 0o700, stat.S_ISDIR),
            (f"{account.home}/.ssh", 0o700, stat.S_ISDIR),
            (f"{account.home}/.ssh/authorized_keys", 0o600, stat.S_ISREG),
        )
        for path, mode, kind in checks:
            try:
                st = os.lstat(self.root.host_path(path))
            except FileNotFoundError:
                problems.append(f"{path} missing")
                continue
            owner_ok = not self.root.apply_ownership or (
                st.st_uid == account.uid and st.st_gid == account.gid
            )
            if not kind(st.st_mode) or stat.S_IMODE(st.st_mode) != mode or not owner_ok:
                problems.append(f"{path} type, mode or owner")
        installed = self.root.read_text(f"{account.home}/.ssh/authorized_keys")
        if installed is not None and installed.splitlines() != keys:
            problems.append("authorized_keys content")
        if problems:
            raise AccessCheckFailed("access check failed: " + ", ".join(problems))

    # ------------------------------------------------------------------ validation

    def _check_username(self, username: str) -> None:
        if not USERNAME_PATTERN.match(username):
            raise HostError(HostErrorType.INVALID_SPEC, "username is not a valid POSIX user name")
        if username in RESERVED_USERNAMES:
            raise HostError(HostErrorType.INVALID_SPEC, f"username {username} is reserved")

    @staticmethod
    def _check_allocation_id(allocation_id: str) -> None:
        if not _ALLOCATION_ID.match(allocation_id):
            raise HostError(HostErrorType.INVALID_SPEC, "allocation_id has unexpected characters")

    @staticmethod
    def _checked_keys(keys: list[str]) -> list[str]:
        checked = []
        for index, key in enumerate(keys):
            key = key.strip()
            # Say where, never what: the key itself must not reach logs or errors.
            if not key or "\n" in key or "\r" in key or "\0" in key:
                raise HostError(
                    HostErrorType.INVALID_SPEC,
                    f"ssh_public_keys[{index}] is not a single-line public key",
                )
            checked.append(key)
        return checked


class AccessCheckFailed(Exception):
    """The read-back after provisioning disagrees with what was written (retried as an
    unexpected host error). Its message names paths and fields, never keys."""


def _storage_group_name(gid: int) -> str:
    if not NAMESPACE_GID_MIN <= gid <= NAMESPACE_GID_MAX:
        raise HostError(HostErrorType.STORAGE_ERROR, f"gid {gid} is not a storage namespace's gid")
    return f"{STORAGE_GROUP_PREFIX}{gid}"


def _members(row: list[str] | None, column: int) -> list[str]:
    if row is None or len(row) <= column:
        return []
    return [member for member in row[column].split(",") if member]


def _phase(progress: Progress, name: str, work: Callable[[], str]) -> None:
    progress(name, PhaseStatus.STARTED)
    message = work()
    progress(name, PhaseStatus.SUCCEEDED, message)
