"""A private PostgreSQL cluster in a folder of our own, run as the `postgres` OS user when we are
root (the server refuses to run as root).

Two roles, as a production database has them: the cluster's superuser, reachable only over the
local socket by the OS user that runs the server (peer authentication), which creates databases
and roles; and the application's role `gpucloud`, no superuser, that owns the application's
databases and logs in over TCP with a password (SCRAM). The password is generated once and kept
in a 0600 file beside the data folder.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from devstack.private_files import write_private


def _bindir() -> Path:
    for candidate in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if Path(candidate, "initdb").exists():
            return Path(candidate)
    found = shutil.which("initdb")
    if found:
        return Path(found).parent
    raise RuntimeError("PostgreSQL server binaries not found; run bin/bootstrap first")


# Commands run as the postgres user start in the data folder (it owns it): a repository cloned
# under a private folder (mktemp's 0700) is not theirs to enter, and PostgreSQL says so on stderr.
def _run_as_postgres() -> list[str]:
    if os.geteuid() != 0:
        return []
    return ["runuser", "-u", "postgres", "--"]


def _server_os_user() -> str:
    return "postgres" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name


class LegacyClusterError(RuntimeError):
    """A data folder made before the application role had a password (its only role is a
    superuser that any local process could log in as without one)."""


@dataclass
class PostgresCluster:
    datadir: Path
    port: int
    user: str = "gpucloud"  # the application's role

    @property
    def socket_dir(self) -> Path:
        return self.datadir / "sock"

    @property
    def password_file(self) -> Path:
        return self.datadir.with_name(f"{self.datadir.name}.{self.user}-password")

    @property
    def admin_user(self) -> str:
        """The cluster's superuser: named after the OS user that runs the server, so that peer
        authentication on the local socket lets that user (and only it) in."""
        return _server_os_user()

    def password(self) -> str:
        return self.password_file.read_text().strip()

    def url(self, database: str, driver: str = "asyncpg") -> str:
        return (
            f"postgresql+{driver}://{self.user}:{self.password()}@127.0.0.1:{self.port}/{database}"
        )

    def _chown(self, path: Path) -> None:
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            os.chown(path, pw.pw_uid, pw.pw_gid)

    def init(self) -> None:
        if (self.datadir / "PG_VERSION").exists():
            if not self.password_file.exists():
                raise LegacyClusterError(
                    f"{self.datadir} was created before the application role had a password; "
                    "start afresh (bin/stack --reset drops the local data)"
                )
            return
        write_private(self.password_file, secrets.token_hex(24) + "\n")
        self.datadir.mkdir(parents=True, exist_ok=True)
        self._chown(self.datadir)
        subprocess.run(
            [
                *_run_as_postgres(),
                str(_bindir() / "initdb"),
                "-D",
                str(self.datadir),
                "-U",
                self.admin_user,
                "--auth-local=peer",
                "--auth-host=scram-sha-256",
                "-E",
                "UTF8",
                "--no-sync",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            cwd=self.datadir,
        )
        with (self.datadir / "postgresql.conf").open("a") as conf:
            conf.write(
                "\n# gpucloud embedded default\n"
                "listen_addresses = '127.0.0.1'\n"
                f"port = {self.port}\n"
                f"unix_socket_directories = '{self.socket_dir}'\n"
                "max_connections = 300\n"
                "fsync = off\nsynchronous_commit = off\nfull_page_writes = off\n"
                "shared_buffers = 256MB\n"
            )

    def start(self) -> None:
        self.init()
        self.socket_dir.mkdir(exist_ok=True)
        self._chown(self.socket_dir)
        if self.running():
            return
        if self.port_taken_by_stranger():
            raise RuntimeError(
                f"port {self.port} is served by another PostgreSQL cluster, not {self.datadir}"
            )
        subprocess.run(
            [
                *_run_as_postgres(),
                str(_bindir() / "pg_ctl"),
                "-D",
                str(self.datadir),
                "-l",
                str(self.datadir / "server.log"),
                "-w",
                "-t",
                "60",
                "start",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            cwd=self.datadir,
        )
        deadline = time.monotonic() + 30
        while not self.running():
            if time.monotonic() > deadline:
                raise RuntimeError(f"PostgreSQL did not start; see {self.datadir}/server.log")
            time.sleep(0.2)
        self._ensure_app_role()

    def _ensure_app_role(self) -> None:
        self.ensure_login_role(self.user, self.password())

    def ensure_login_role(self, name: str, password: str) -> None:
        """A role that logs in with `password` and is no superuser (created if missing; the
        password set again). The password goes on psql's stdin, never its command line (which
        `ps` shows); role names come from our own code."""
        self.psql(
            f"""DO $$ BEGIN
              IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{name}') THEN
                CREATE ROLE "{name}" LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE;
              END IF;
            END $$;
            ALTER ROLE "{name}" PASSWORD '{password}'"""
        )

    def running(self) -> bool:
        """This cluster is up: a server answers on the port *and* runs from our datadir (another
        cluster on the same port is not ours to use)."""
        return self._answers() and self.serves_this_datadir()

    def port_taken_by_stranger(self) -> bool:
        return self._answers() and not self.serves_this_datadir()

    def _answers(self) -> bool:
        result = subprocess.run(
            [str(_bindir() / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port)],
            capture_output=True,
            check=False,
        )
        return result.returncode == 0

    def serves_this_datadir(self) -> bool:
        try:
            served = self.psql("SHOW data_directory").strip()
        except (subprocess.CalledProcessError, OSError):
            return False  # not PostgreSQL, or our superuser does not exist there: not ours
        return bool(served) and Path(served).resolve() == self.datadir.resolve()

    def stop(self) -> None:
        if not (self.datadir / "postmaster.pid").exists():
            return
        subprocess.run(
            [
                *_run_as_postgres(),
                str(_bindir() / "pg_ctl"),
                "-D",
                str(self.datadir),
                "-m",
                "fast",
                "-w",
                "stop",
            ],
            check=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=self.datadir,
        )

    def psql(self, sql: str, database: str = "postgres") -> str:
        """Run SQL as the cluster's superuser, over the local socket."""
        result = subprocess.run(
            [
                *_run_as_postgres(),
                str(_bindir() / "psql"),
                "-h",
                str(self.socket_dir),
                "-p",
                str(self.port),
                "-U",
                self.admin_user,
                "-d",
                database,
                "-v",
                "ON_ERROR_STOP=1",
                "-qAt",
            ],
            input=sql,
            check=True,
            capture_output=True,
            text=True,
            cwd=self.datadir,
        )
        return result.stdout

    def create_database(
        self, name: str, *, recreate: bool = False, owner: str | None = None
    ) -> None:
        if recreate:
            self.psql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        # Database names come from our own code, never from a request.
        exists = self.psql(f"SELECT 1 FROM pg_database WHERE datname = '{name}'")  # noqa: S608
        if not exists.strip():
            # Owned by the application's role: it creates its schema and extensions there
            # (btree_gist is a trusted extension) without being a superuser.
            self.psql(f'CREATE DATABASE "{name}" OWNER "{owner or self.user}"')


@contextlib.contextmanager
def throwaway_cluster(folder: Path, port: int) -> Iterator[PostgresCluster]:
    """A running cluster in `folder` (made afresh, world-traversable: the server runs as the
    `postgres` user when we are root), for tests and benchmarks; stopped and `folder` deleted on
    exit. The caller creates and migrates its databases."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(mode=0o755)
    if os.geteuid() == 0:
        pw = pwd.getpwnam("postgres")
        os.chown(folder, pw.pw_uid, pw.pw_gid)
    cluster = PostgresCluster(folder / "data", port)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(folder, ignore_errors=True)
