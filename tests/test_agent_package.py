"""The agent's Debian package (bin/build-agent-deb): what the rendered cloud-init installs on a
MAAS-deployed node from `agent.agent_package_url`. Built here as a release would build it, then
unpacked and run the way the node runs it: /usr/bin/gpucloud-agent, the unit's ExecStart."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from activities.cloud_init import AGENT_EXEC

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "bin" / "build-agent-deb"
DEBIAN_PYTHON = Path("/usr/bin/python3.11")
PEM_PRIVATE_KEY = re.compile(rb"-----BEGIN [A-Z ]*PRIVATE KEY-----\r?\n[A-Za-z0-9+/=\r\n]{64}")

pytestmark = pytest.mark.skipif(
    not DEBIAN_PYTHON.exists(), reason="the package is built on Debian's python3.11"
)


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    built = subprocess.run([str(BUILD), str(out)], check=True, capture_output=True, text=True)
    deb = Path(built.stdout.strip().splitlines()[-1])
    assert deb.parent == out
    assert deb.name.startswith("gpucloud-agent_")
    return deb


@pytest.fixture(scope="module")
def unpacked(package: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("node-root")
    subprocess.run(["dpkg-deb", "-x", str(package), str(root)], check=True)
    return root


def control_fields(package: Path) -> dict[str, str]:
    text = subprocess.run(
        ["dpkg-deb", "-f", str(package)], check=True, capture_output=True, text=True
    ).stdout
    return dict(
        line.split(": ", 1) for line in text.splitlines() if ": " in line and line[0] != " "
    )


def test_the_package_says_what_it_is_and_needs_only_debians_python(package: Path) -> None:
    fields = control_fields(package)
    assert fields["Package"] == "gpucloud-agent"
    assert fields["Architecture"] == "amd64"
    assert fields["Depends"] == "python3.11"
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    assert fields["Version"].startswith("0.")
    assert fields["Version"].endswith(f"+git{commit}")


def test_the_units_exec_start_is_the_packaged_agent(unpacked: Path) -> None:
    executable = shlex.split(AGENT_EXEC)[0]
    link = unpacked / executable.lstrip("/")
    target = Path(os.readlink(link))
    assert target.parts[:3] == ("/", "opt", "gpucloud-agent")
    shipped = unpacked / str(target).lstrip("/")
    # Unpacked anywhere, the packaged environment runs (its scripts find their interpreter
    # relative to themselves), on Debian's interpreter, not the build machine's.
    shown = subprocess.run([str(shipped), "--help"], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "--config" in shown.stdout
    venv = shipped.parent.parent
    assert f"home = {DEBIAN_PYTHON.parent}" in (venv / "pyvenv.cfg").read_text()


def test_the_package_holds_the_agents_dependencies_and_no_control_plane_stack(
    unpacked: Path,
) -> None:
    python = unpacked / "opt" / "gpucloud-agent" / "bin" / "python"
    probe = (
        "import importlib.util as u, json\n"
        "names = ['agent.main', 'temporalio', 'libvirt', 'pyroute2', 'websockets', 'pynvml',"
        " 'litestar', 'sqlalchemy', 'asyncpg', 'stripe', 'asyncssh']\n"
        "print(json.dumps({n: u.find_spec(n) is not None for n in names}))\n"
    )
    found = subprocess.run(
        [str(python), "-c", probe], check=True, capture_output=True, text=True, timeout=60
    ).stdout
    present = json.loads(found)
    assert all(present[n] for n in ("agent.main", "temporalio", "libvirt", "pyroute2", "pynvml"))
    # A node runs no web stack, database driver or payment client: none is shipped to it.
    assert not any(present[n] for n in ("litestar", "sqlalchemy", "asyncpg", "stripe", "asyncssh"))


def test_the_package_carries_no_key_token_or_site_configuration(unpacked: Path) -> None:
    # One package serves every node: whatever is secret or per-node comes from cloud-init and
    # enrollment, never from the package (its URL is fetched by every node of every site).
    shipped = [p.relative_to(unpacked) for p in unpacked.rglob("*") if p.is_file()]
    assert not any(p.parts[0] == "etc" for p in shipped)
    names = {p.name for p in shipped}
    assert not names & {"payload.key", "agent.toml", "identity.json", ".env"}
    assert not any(p.suffix in {".pyc", ".key"} for p in shipped)
    # Certificates ship (CA bundles), private keys never: no PEM private-key block with a body
    # (libraries that parse keys name the header in their code; that is not a key).
    assert not [p for p in shipped if PEM_PRIVATE_KEY.search((unpacked / p).read_bytes())]
