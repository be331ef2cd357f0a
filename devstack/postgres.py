"""A private PostgreSQL cluster in a folder of our own, run as the `postgres` OS user when we are
root (the server refuses to run as root)."""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


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


@dataclass
class PostgresCluster:
    datadir: Path
    port: int
    user: str = "gpucloud"

    @property
    def socket_dir(self) -> Path:
        return self.datadir / "sock"

    def url(self, database: str, driver: str = "asyncpg") -> str:
        return f"postgresql+{driver}://{self.user}@127.0.0.1:{self.port}/{database}"

    def _chown(self, path: Path) -> None:
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            os.chown(path, pw.pw_uid, pw.pw_gid)

    def init(self) -> None:
        if (self.datadir / "PG_VERSION").exists():
            return
        self.datadir.mkdir(parents=True, exist_ok=True)
        self._chown(self.datadir)
        subprocess.run(
            [
                *_run_as_postgres(),
                str(_bindir() / "initdb"),
                "-D",
                str(self.datadir),
                "-U",
                self.user,
                "--auth=trust",
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
        result = subprocess.run(
            [
                str(_bindir() / "psql"),
                "-h",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-U",
                self.user,
                "-d",
                database,
                "-v",
                "ON_ERROR_STOP=1",
                "-qAtc",
                sql,
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        return result.stdout

    def create_database(self, name: str, *, recreate: bool = False) -> None:
        if recreate:
            self.psql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        # Database names come from our own code, never from a request.
        exists = self.psql(f"SELECT 1 FROM pg_database WHERE datname = '{name}'")  # noqa: S608
        if not exists.strip():
            self.psql(f'CREATE DATABASE "{name}"')


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
