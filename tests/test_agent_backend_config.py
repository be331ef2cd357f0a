"""The production agent: its services built from the agent config (agent.toml + agent.d
drop-ins) on a host root, and the binary's refusals (no payload key without --dev)."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.backends.from_config import node_services_from_config
from agent.backends.libvirt_slice import LibvirtSliceBackend
from agent.backends.system_root import SystemRoot
from agent.config_file import ConfigError, read_agent_config
from agent.main import EXIT_CONFIG
from core.codec import key_id
from sim.machine_image import build_machine
from tests.test_agent_host import baremetal_spec

HOST_XML = Path(__file__).parent / "data" / "libvirt" / "host.xml"
BASE = 'api_url = "https://api.example"\nenrollment_token = "gpe_x"\n'


def write_config(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "agent.toml"
    path.write_text(BASE + body)
    return path


class _Progress:
    cancelled = False

    def __call__(self, *args: object, **kwargs: object) -> None:
        pass

    def wait(self, seconds: float | None) -> None:
        pass

    def suspend_heartbeats(self) -> None:
        pass


def test_drop_ins_override_agent_toml_table_by_table(tmp_path: Path) -> None:
    config = write_config(tmp_path, '[libvirt]\nuri = "qemu:///system"\nuplink = "bond0"\n')
    (tmp_path / "agent.d").mkdir()
    (tmp_path / "agent.d/50-site.toml").write_text('[libvirt]\nuplink = "bond1"\n')
    (tmp_path / "agent.d/10-early.toml").write_text('[libvirt]\nuplink = "eth9"\n')
    data = read_agent_config(config)
    assert data["libvirt"] == {"uri": "qemu:///system", "uplink": "bond1"}
    assert data["api_url"] == "https://api.example"


def test_defaults_are_a_real_node_and_both_shapes_are_served(tmp_path: Path) -> None:
    services = node_services_from_config({}, SystemRoot(Path("/")), hostname="n1.example")
    slices = services.host.slice  # type: ignore[attr-defined]
    assert isinstance(slices, LibvirtSliceBackend)
    assert slices.uri == "qemu:///system"
    assert services.host.baremetal is not None  # type: ignore[attr-defined]


def test_bare_metal_runs_on_the_host_root(tmp_path: Path) -> None:
    machine = build_machine(tmp_path / "m", address="10.9.0.5")
    data = read_agent_config(machine.root / "etc/gpucloud/agent.d/50-machine.toml")
    services = node_services_from_config(data, SystemRoot(machine.root))
    spec = baremetal_spec("n1")
    outcome = services.host.provision_baremetal_user(spec, _Progress())
    assert outcome.connect_host == "10.9.0.5"
    # The account is a real entry of the machine's passwd, in the tenant uid range, with the
    # tenant's key installed in its home on that disk.
    entries = [line.split(":") for line in (machine.root / "etc/passwd").read_text().splitlines()]
    (tenant,) = [e for e in entries if e[0] == "tenant"]
    assert 20000 <= int(tenant[2]) <= 29999
    keys = machine.root / tenant[5].lstrip("/") / ".ssh/authorized_keys"
    assert spec.ssh_public_keys[0] in keys.read_text()


@pytest.mark.parametrize(
    ("body", "complaint"),
    [
        ('[libvirt]\nreadiness = "telepathy"\n', "readiness must be one of"),
        ('[libvirt]\nreadiness = "fixed"\n', "needs fixed_address"),
        ("[libvirt]\nimages = 3\n", "maps image names"),
        ("libvirt = 3\n", "[libvirt] must be a table"),
        ("[users]\nuid_min = 0\n", "[users]"),
    ],
)
def test_bad_backend_config_is_refused_clearly(tmp_path: Path, body: str, complaint: str) -> None:
    with pytest.raises(ConfigError) as err:
        node_services_from_config(
            read_agent_config(write_config(tmp_path, body)), SystemRoot(tmp_path)
        )
    assert complaint in str(err.value)


def _agent(tmp_path: Path, *args: str, key: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "GPUCLOUD_CODEC_KEY"}
    if key is not None:
        env["GPUCLOUD_CODEC_KEY"] = key
    env["GPUCLOUD_AGENT_ROOT"] = str(tmp_path)
    # Nobody answers there: an agent past its key check fails to connect instead of serving.
    env["GPUCLOUD_TEMPORAL_ADDRESS"] = "127.0.0.1:9"
    (tmp_path / "etc/gpucloud").mkdir(parents=True, exist_ok=True)
    config = tmp_path / "etc/gpucloud/agent.toml"
    if not config.exists():
        # An API nobody answers: a start that gets past the key check fails at enrollment.
        config.write_text(
            'api_url = "http://127.0.0.1:9"\nenrollment_token = "gpe_x"\n'
            'state_dir = "/var/lib/gpucloud-agent"\n'
        )
    return subprocess.run(
        [sys.executable, "-m", "agent.main", "--config", "/etc/gpucloud/agent.toml", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


NODE_ID = "7f1c2d3e-0000-4000-8000-000000000001"
NODE_KEY = "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY="  # base64 of 32 bytes


def test_the_agent_refuses_to_start_without_a_payload_key(tmp_path: Path) -> None:
    # Not enrolling (--node-id) and no key given: nothing to encrypt payloads with.
    refused = _agent(tmp_path, "--node-id", NODE_ID)
    assert refused.returncode == EXIT_CONFIG
    assert "no payload key" in refused.stderr
    # Enrolling: the key comes with the enrollment answer, so the agent goes to enroll.
    enrolling = _agent(tmp_path)
    assert enrolling.returncode == 1
    assert "enrollment failed (unreachable)" in enrolling.stderr
    # --dev allows the public development key.
    dev = _agent(tmp_path, "--dev", "--node-id", NODE_ID)
    assert dev.returncode != EXIT_CONFIG, dev.stderr
    assert "no payload key" not in dev.stderr
    # A key file named by the config (a cloud-init from before node keys wrote one) counts as
    # explicit: the cluster key, used as before.
    (tmp_path / "etc/gpucloud/payload.key").write_text("MDEyMzQ1Njc4OWFiY2RlZg==\n")
    with (tmp_path / "etc/gpucloud/agent.toml").open("a") as f:
        f.write('payload_key_file = "/etc/gpucloud/payload.key"\n')
    keyed = _agent(tmp_path, "--node-id", NODE_ID)
    assert keyed.returncode != EXIT_CONFIG, keyed.stderr
    assert "gpe_x" not in keyed.stderr + dev.stderr + refused.stderr + enrolling.stderr


def test_an_enrolled_agent_starts_only_with_the_key_its_identity_names(tmp_path: Path) -> None:
    """Enrollment stores the node's key and names its key id in the identity: a key file that
    holds another key (swapped, truncated) stops the agent with a config error instead of
    encrypting with the wrong key."""
    state = tmp_path / "var/lib/gpucloud-agent"
    state.mkdir(parents=True)
    identity = {
        "node_id": NODE_ID,
        "hostname": "n1",
        "temporal_address": "127.0.0.1:9",
        "temporal_namespace": "default",
        "task_queue": f"node-{NODE_ID}",
        "payload_key_id": key_id(base64.b64decode(NODE_KEY)),
    }
    (state / "identity.json").write_text(json.dumps(identity))
    (state / "payload.key").write_text("MDEyMzQ1Njc4OWFiY2RlZg==\n")  # not the enrolled key
    swapped = _agent(tmp_path)
    assert swapped.returncode == EXIT_CONFIG
    assert "does not hold the key this node enrolled with" in swapped.stderr
    (state / "payload.key").write_text(NODE_KEY + "\n")
    enrolled = _agent(tmp_path)
    assert enrolled.returncode != EXIT_CONFIG, enrolled.stderr  # on to Temporal, unreachable
    assert NODE_KEY not in enrolled.stderr + swapped.stderr
