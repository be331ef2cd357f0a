"""First-boot cloud-init for MAAS-deployed nodes (docs/lifecycles/onboarding.md#cloud-init,
docs/lifecycles/onboarding.md#hardware-sync): a versioned composition of ordered layers, rendered
from typed, validated input. Nothing here runs anything; the result is the user-data handed to MAAS
deploy.

Layers, in this order (a layer with nothing to do is left out and not listed):

1. ``site_bootstrap``: the infra-owned site bootstrap bundle *reference* only. It is written to
   ``/etc/gpucloud/site-bootstrap.ref`` and handed to the image-provided hook
   ``/usr/lib/gpucloud/site-bootstrap-hook`` (``SITE_BOOTSTRAP_HOOK``; the hook fetches,
   verifies and runs the versioned bundle). No shell from the API is ever inlined. The hook's
   exit status goes to ``/var/lib/gpucloud/bootstrap/site_bootstrap.status`` so a site
   bootstrap failure is told apart from a GPUasService bootstrap failure. The site's upstream
   DNS servers (if any) become a systemd-resolved drop-in in this layer.
2. ``deploy_user``: the site's deploy user with a SHA-512 crypt password hash; no sudo unless
   the site says so.
3. ``agent_bootstrap``: ``/etc/gpucloud/agent.toml`` (0600) with ``api_url``,
   ``enrollment_token`` and ``state_dir`` exactly as `agent.enrollment.AgentConfig.load` reads
   it, and ``[storage] export_root`` (where the agent finds the shared directory storage
   provider's tree, agent/storage_mounts.py) when the control plane has one; no payload key:
   the agent gets its node's own key at enrollment (core/codec.py), so user data, which MAAS
   keeps in its database, holds nothing that opens a Temporal payload; the CA bundle (if
   given) via cloud-init ``ca_certs`` and ``SSL_CERT_FILE`` in the unit; the agent package (if
   a URL is given: an https ``.deb``, installed by a fixed script that reads the URL from a
   file); the ``gpucloud-agent.service`` unit.
4. ``hardware_sync``: ``/etc/maas/maas-machine-creds.yml`` (0600) with the machine token and
   the MAAS status endpoint, and the hardware-sync service and timer from the same templates
   ``node.hw_sync_reseed`` writes (`agent.maintenance.render_hw_sync_service/_timer`), with the
   site's interval. Required for MAAS-managed nodes (§9.1), so always present.
5. ``share_disks``: destructive initialisation of an *explicit* list of non-root disks, mounted
   as ``/share0``, ``/share1``, ... Only when the list is non-empty; a non-empty list without
   ``allow_destructive_share_init=True`` is refused. The script refuses the root disk and any
   disk with a mounted filesystem, and runs once (marker file).
6. ``roce_routing``: a policy-routing script and oneshot unit generated from the RoCE
   assignments: per interface, table ``100+i``, a connected route, a default route via the
   gateway (for a /31 without a gateway: the peer address) and a source rule.
7. ``runcmd``: daemon-reload, then the site hook, share disks, RoCE routing, agent install,
   hardware-sync timer and agent, enabled and started in that order.

The rendered document is ``#cloud-config`` followed by a JSON body (JSON is YAML 1.2, which
cloud-init parses; JSON escaping makes every string safe). Its version is
``CLOUD_INIT_FORMAT/<sha256 of the content>``.

Secrets: the content carries the enrollment token, the MAAS machine token and the deploy
password hash. Never log it, never put it in exceptions; callers keep it in Temporal history
only through the payload codec. Every secret field has ``repr=False`` and every validation
error names the field, never its value.

The deploy password: ``DeployUser.password_hash`` is a SHA-512 crypt hash (``$6$...``). Callers
holding the plain password (from Vault) hash it with `sha512_crypt` (pure Python, no ``crypt``
module in 3.13) and a salt from `new_salt`, once, so rendering stays deterministic.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import re
import secrets
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from urllib.parse import urlsplit

from contracts.node_files import (
    DEFAULT_CONFIG_PATH,
    DEFAULT_STATE_DIR,
    HwSyncConfig,
    render_hw_sync_service,
    render_hw_sync_timer,
)

CLOUD_INIT_FORMAT = "gpucloud-cloud-init/1"
HEADER = "#cloud-config\n"

LAYER_SITE_BOOTSTRAP = "site_bootstrap"
LAYER_DEPLOY_USER = "deploy_user"
LAYER_AGENT_BOOTSTRAP = "agent_bootstrap"
LAYER_HARDWARE_SYNC = "hardware_sync"
LAYER_SHARE_DISKS = "share_disks"
LAYER_ROCE_ROUTING = "roce_routing"
LAYER_RUNCMD = "runcmd"

AGENT_CONFIG_PATH = str(DEFAULT_CONFIG_PATH)  # /etc/gpucloud/agent.toml
AGENT_UNIT = "gpucloud-agent.service"
AGENT_UNIT_PATH = f"/etc/systemd/system/{AGENT_UNIT}"
AGENT_EXEC = f"/usr/bin/gpucloud-agent --config {AGENT_CONFIG_PATH}"
# gpucloud-agent's exit status for a config it cannot start with (agent/main.py EXIT_CONFIG).
AGENT_CONFIG_EXIT_STATUS = 78
AGENT_PACKAGE_URL_PATH = "/etc/gpucloud/agent-package.url"
AGENT_INSTALL_SCRIPT = "/usr/local/lib/gpucloud/install-agent.sh"
SYSTEM_CA_FILE = "/etc/ssl/certs/ca-certificates.crt"
SITE_BOOTSTRAP_REF_PATH = "/etc/gpucloud/site-bootstrap.ref"
SITE_BOOTSTRAP_HOOK = "/usr/lib/gpucloud/site-bootstrap-hook"
SITE_BOOTSTRAP_RUNNER = "/usr/local/lib/gpucloud/run-site-bootstrap.sh"
BOOTSTRAP_STATUS_DIR = "/var/lib/gpucloud/bootstrap"
RESOLVED_DROPIN_PATH = "/etc/systemd/resolved.conf.d/60-gpucloud-upstream-dns.conf"
SHARE_DISKS_LIST_PATH = "/etc/gpucloud/share-disks.list"
SHARE_DISKS_SCRIPT = "/usr/local/lib/gpucloud/init-share-disks.sh"
ROCE_SCRIPT = "/usr/local/lib/gpucloud/roce-routing.sh"
ROCE_UNIT = "gpucloud-roce-routing.service"
ROCE_UNIT_PATH = f"/etc/systemd/system/{ROCE_UNIT}"
ROCE_TABLE_BASE = 100
ROCE_RULE_PRIORITY_BASE = 1000
NODE_INFO_PATH = "/etc/gpucloud/node.json"

HW_SYNC = HwSyncConfig()
HW_SYNC_INTERVAL_RANGE_MINUTES = (1, 1440)  # as node.hw_sync_reseed accepts


class CloudInitError(ValueError):
    """Invalid cloud-init input. The message names the field, never a value of a secret."""


class DestructiveStepNotAllowed(CloudInitError):
    """share_disks is non-empty but the explicit destructive flag is not set."""


# ----------------------------------------------------------------------------- input


@dataclass(frozen=True)
class DeployUser:
    name: str
    password_hash: str = field(repr=False)  # SHA-512 crypt ($6$...); see sha512_crypt
    sudo: bool = False  # site policy; default: no sudo
    ssh_authorized_keys: tuple[str, ...] = ()


@dataclass(frozen=True)
class SiteFacts:
    name: str
    deploy_user: DeployUser
    hardware_sync_interval: str = "15m"  # MaasSitePolicy.hardware_sync_interval: ^[0-9]+[smh]$
    upstream_dns_servers: tuple[str, ...] = ()
    site_bootstrap_bundle_ref: str | None = None


@dataclass(frozen=True)
class NodeFacts:
    hostname: str
    maas_system_id: str
    maas_url: str  # the MAAS base URL, e.g. http://maas.example:5240/MAAS


@dataclass(frozen=True)
class AgentBootstrap:
    api_url: str
    enrollment_token: str = field(repr=False)
    agent_package_url: str | None = None
    ca_bundle_pem: str | None = None
    state_dir: str = str(DEFAULT_STATE_DIR)
    # `[storage] export_root`: the shared directory storage provider's root, which the worker and
    # every node see at the same place (activities/storage_provider.py); None: no [storage]
    # table, so the node's storage.mount and storage.unmount answer `unsupported`.
    storage_export_root: str | None = None


@dataclass(frozen=True)
class MaasMachineCredentials:
    """Same fields as activities.maas.types.MachineToken (use `from_token`)."""

    consumer_key: str = field(repr=False)
    token_key: str = field(repr=False)
    token_secret: str = field(repr=False)

    @classmethod
    def from_token(cls, token: object) -> MaasMachineCredentials:
        return cls(
            consumer_key=str(getattr(token, "consumer_key")),  # noqa: B009
            token_key=str(getattr(token, "token_key")),  # noqa: B009
            token_secret=str(getattr(token, "token_secret")),  # noqa: B009
        )


@dataclass(frozen=True)
class RoceAssignment:
    interface: str
    ipv4_cidr: str  # the node's address with prefix, e.g. 172.30.9.61/31
    gateway: str | None = None  # default for a /31: the peer address


@dataclass(frozen=True)
class CloudInitInput:
    site: SiteFacts
    node: NodeFacts
    agent: AgentBootstrap
    # None when the machine has no token yet: MAAS creates it only when deploy renders the
    # preseed, so onboarding deploys without it and seeds the file over SSH afterwards
    # (docs/lifecycles/onboarding.md#stages EnsureHardwareSyncConfigured); the units are installed
    # either way.
    maas_machine_token: MaasMachineCredentials | None = None
    roce: tuple[RoceAssignment, ...] = ()
    # Explicit non-root disks to wipe and mount as /share0, /share1, ...; empty: no destruction.
    share_disks: tuple[str, ...] = ()
    allow_destructive_share_init: bool = False


@dataclass(frozen=True)
class RenderedCloudInit:
    content: str = field(repr=False)
    version: str
    layers: tuple[str, ...]

    def b64(self) -> str:
        """The user_data form MAAS deploy takes."""
        return base64.b64encode(self.content.encode()).decode()


# ----------------------------------------------------------------------------- validation

_HOST_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$", re.IGNORECASE)
_IFNAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,14}$")
_SYSTEM_ID = re.compile(r"^[a-z0-9]{1,32}$")
_USER = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
_SHA512_CRYPT = re.compile(r"^\$6\$(rounds=[0-9]{1,9}\$)?[./A-Za-z0-9]{1,16}\$[./A-Za-z0-9]{86}$")
_TOKEN_PART = re.compile(r"^[A-Za-z0-9._~+/=-]{1,256}$")
_ENROLLMENT_TOKEN = re.compile(r"^[\x21-\x7e]{1,1024}$")  # printable ASCII, no whitespace
_BUNDLE_REF = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+=#-]{0,299}$")
_INTERVAL = re.compile(r"^([0-9]{1,6})([smh])$")
_DISK = re.compile(
    r"^/dev/(disk/by-(id|path)/[A-Za-z0-9:._+-]{1,200}|sd[a-z]{1,3}|vd[a-z]{1,3}"
    r"|nvme[0-9]{1,3}n[0-9]{1,3})$"
)
_SSH_KEY = re.compile(
    r"^(ssh-(ed25519|rsa)|ecdsa-sha2-nistp(256|384|521)|sk-[a-z0-9@.-]+) "
    r"[A-Za-z0-9+/=]{16,16384}( [\x20-\x7e]{0,200})?$"
)
_PEM = re.compile(
    r"^(-----BEGIN CERTIFICATE-----\n[A-Za-z0-9+/=\n]+-----END CERTIFICATE-----\n?)+$"
)
_SITE_NAME = re.compile(r"^[\x20-\x7e]{1,100}$")


def _fail(field_name: str, why: str) -> CloudInitError:
    return CloudInitError(f"{field_name}: {why}")


def validate_hostname(value: str, field_name: str = "node.hostname") -> str:
    labels = value.split(".") if isinstance(value, str) else []
    if not labels or len(value) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
        raise _fail(field_name, "not a valid hostname (RFC 1123)")
    return value


def validate_interface(value: str, field_name: str = "interface") -> str:
    if not isinstance(value, str) or not _IFNAME.fullmatch(value) or value in (".", ".."):
        raise _fail(field_name, "not a valid interface name")
    return value


def validate_url(value: str, field_name: str, *, https_only: bool = False) -> str:
    if not isinstance(value, str) or not re.fullmatch(r"[\x21-\x7e]{1,2000}", value):
        raise _fail(field_name, "must be a printable ASCII URL without spaces")
    if any(c in value for c in "\"'`\\<>{}|^"):
        raise _fail(field_name, "contains characters not allowed in a URL")
    parts = urlsplit(value)
    schemes = ("https",) if https_only else ("http", "https")
    if parts.scheme not in schemes or not parts.hostname:
        raise _fail(field_name, f"must be an {'/'.join(schemes)} URL with a host")
    if parts.username is not None or parts.password is not None:
        raise _fail(field_name, "must not carry credentials")
    return value


def parse_interface_cidr(value: str, field_name: str) -> ipaddress.IPv4Interface:
    try:
        iface = ipaddress.IPv4Interface(value)
    except (ValueError, TypeError):
        raise _fail(field_name, "not an IPv4 address with prefix length (a.b.c.d/n)") from None
    if "/" not in str(value) or (iface.network.prefixlen == 32 and iface.ip.is_unspecified):
        raise _fail(field_name, "needs an explicit prefix length")
    return iface


def hardware_sync_minutes(interval: str) -> int:
    """The site policy's interval (``15m``, ``900s``, ``1h``) in whole minutes."""
    match = _INTERVAL.fullmatch(interval) if isinstance(interval, str) else None
    if not match:
        raise _fail("site.hardware_sync_interval", "must look like 15m, 900s or 1h")
    number, unit = int(match.group(1)), match.group(2)
    seconds = number * {"s": 1, "m": 60, "h": 3600}[unit]
    low, high = HW_SYNC_INTERVAL_RANGE_MINUTES
    if seconds % 60 or not low <= seconds // 60 <= high:
        raise _fail("site.hardware_sync_interval", f"must be whole minutes within {low}..{high}")
    return seconds // 60


@dataclass(frozen=True)
class _Route:
    interface: str
    address: ipaddress.IPv4Interface
    gateway: ipaddress.IPv4Address
    table: int
    priority: int


def _roce_routes(assignments: Sequence[RoceAssignment]) -> list[_Route]:
    routes: list[_Route] = []
    seen: set[str] = set()
    for i, a in enumerate(assignments):
        name = f"roce[{i}]"
        validate_interface(a.interface, f"{name}.interface")
        if a.interface in seen:
            raise _fail(f"{name}.interface", "assigned twice")
        seen.add(a.interface)
        address = parse_interface_cidr(a.ipv4_cidr, f"{name}.ipv4_cidr")
        net = address.network
        if address.ip in (net.network_address, net.broadcast_address) and net.prefixlen < 31:
            raise _fail(f"{name}.ipv4_cidr", "is the network or broadcast address")
        if a.gateway is None:
            if net.prefixlen != 31:
                raise _fail(f"{name}.gateway", "required unless the prefix is /31")
            peer = [h for h in (net.network_address, net.broadcast_address) if h != address.ip]
            gateway = peer[0]
        else:
            try:
                gateway = ipaddress.IPv4Address(a.gateway)
            except ValueError:
                raise _fail(f"{name}.gateway", "not an IPv4 address") from None
            if gateway not in net or gateway == address.ip:
                raise _fail(f"{name}.gateway", "must be another address in the interface subnet")
        routes.append(
            _Route(a.interface, address, gateway, ROCE_TABLE_BASE + i, ROCE_RULE_PRIORITY_BASE + i)
        )
    return routes


def _check_absolute_path(
    value: str, field_name: str, *, component: str = r"[A-Za-z0-9._-]+"
) -> None:
    if (
        not isinstance(value, str)
        or not re.fullmatch(rf"(/{component})+", value)
        or any(p in (".", "..") for p in PurePosixPath(value).parts)
    ):
        raise _fail(field_name, "must be an absolute path of plain components")


def _validate(spec: CloudInitInput) -> tuple[int, list[_Route]]:
    site, node, agent, token = spec.site, spec.node, spec.agent, spec.maas_machine_token
    if not isinstance(site.name, str) or not _SITE_NAME.fullmatch(site.name):
        raise _fail("site.name", "must be 1..100 printable ASCII characters")
    user = site.deploy_user
    if not isinstance(user.name, str) or not _USER.fullmatch(user.name) or user.name == "root":
        raise _fail("site.deploy_user.name", "not a valid non-root user name")
    if not isinstance(user.password_hash, str) or not _SHA512_CRYPT.fullmatch(user.password_hash):
        raise _fail("site.deploy_user.password_hash", "must be a SHA-512 crypt hash ($6$...)")
    for i, key in enumerate(user.ssh_authorized_keys):
        if not isinstance(key, str) or not _SSH_KEY.fullmatch(key):
            raise _fail(f"site.deploy_user.ssh_authorized_keys[{i}]", "not an OpenSSH public key")
    minutes = hardware_sync_minutes(site.hardware_sync_interval)
    for i, server in enumerate(site.upstream_dns_servers):
        try:
            ipaddress.ip_address(server)
        except ValueError:
            raise _fail(f"site.upstream_dns_servers[{i}]", "not an IP address") from None
    ref = site.site_bootstrap_bundle_ref
    if ref is not None and (not isinstance(ref, str) or not _BUNDLE_REF.fullmatch(ref)):
        raise _fail("site.site_bootstrap_bundle_ref", "not a valid bundle reference")

    validate_hostname(node.hostname)
    if not isinstance(node.maas_system_id, str) or not _SYSTEM_ID.fullmatch(node.maas_system_id):
        raise _fail("node.maas_system_id", "not a MAAS system id")
    validate_url(node.maas_url, "node.maas_url")

    validate_url(agent.api_url, "agent.api_url")
    if not isinstance(agent.enrollment_token, str) or not _ENROLLMENT_TOKEN.fullmatch(
        agent.enrollment_token
    ):
        raise _fail("agent.enrollment_token", "must be 1..1024 printable ASCII characters")
    if agent.agent_package_url is not None:
        validate_url(agent.agent_package_url, "agent.agent_package_url", https_only=True)
        if not urlsplit(agent.agent_package_url).path.endswith(".deb"):
            raise _fail("agent.agent_package_url", "must point at a .deb package")
    if agent.ca_bundle_pem is not None and (
        not isinstance(agent.ca_bundle_pem, str)
        or not _PEM.fullmatch(agent.ca_bundle_pem.strip() + "\n")
    ):
        raise _fail("agent.ca_bundle_pem", "must be one or more PEM certificates")
    _check_absolute_path(agent.state_dir, "agent.state_dir")
    if agent.storage_export_root is not None:
        # The operator's path as the worker has it (a checkout's .state/storage under bin/stack):
        # any printable ASCII but '/' in a component.
        _check_absolute_path(
            agent.storage_export_root,
            "agent.storage_export_root",
            component=r"[\x20-\x2e\x30-\x7e]+",
        )

    for part in ("consumer_key", "token_key", "token_secret") if token is not None else ():
        value = getattr(token, part)
        if not isinstance(value, str) or not _TOKEN_PART.fullmatch(value):
            raise _fail(f"maas_machine_token.{part}", "missing or malformed")

    routes = _roce_routes(spec.roce)

    if spec.share_disks and not spec.allow_destructive_share_init:
        raise DestructiveStepNotAllowed(
            "share_disks: destructive /shareN initialisation needs allow_destructive_share_init"
        )
    seen: set[str] = set()
    for i, disk in enumerate(spec.share_disks):
        if not isinstance(disk, str) or not _DISK.fullmatch(disk):
            raise _fail(f"share_disks[{i}]", "not a whole-disk device path (/dev/... )")
        if disk in seen:
            raise _fail(f"share_disks[{i}]", "listed twice")
        seen.add(disk)
    return minutes, routes


# ----------------------------------------------------------------------------- rendering


def _toml_str(value: str) -> str:
    # Values are validated printable ASCII, for which a JSON string is a TOML basic string.
    return json.dumps(value, ensure_ascii=True)


def render_agent_toml(agent: AgentBootstrap) -> str:
    """The agent config file, as `agent.enrollment.AgentConfig.load` reads it."""
    return (
        "# Written by cloud-init (gpucloud agent_bootstrap); read by gpucloud-agent.\n"
        f"api_url = {_toml_str(agent.api_url)}\n"
        f"enrollment_token = {_toml_str(agent.enrollment_token)}\n"
        f"state_dir = {_toml_str(agent.state_dir)}\n"
        # A table last: every key above belongs to the top level.
        + (
            f"\n[storage]\nexport_root = {_toml_str(agent.storage_export_root)}\n"
            if agent.storage_export_root is not None
            else ""
        )
    )


def render_machine_creds(node: NodeFacts, token: MaasMachineCredentials) -> str:
    """/etc/maas/maas-machine-creds.yml (JSON, which is YAML) for maas-run-scripts."""
    endpoint = f"{node.maas_url.rstrip('/')}/metadata/status/{node.maas_system_id}"
    creds = {
        "reporting": {
            "maas": {
                "type": "webhook",
                "endpoint": endpoint,
                "consumer_key": token.consumer_key,
                "token_key": token.token_key,
                "token_secret": token.token_secret,
            }
        }
    }
    return json.dumps(creds, indent=2, sort_keys=True) + "\n"


def render_agent_unit(*, ca_bundle: bool) -> str:
    env = f"Environment=SSL_CERT_FILE={SYSTEM_CA_FILE}\n" if ca_bundle else ""
    return (
        "# Written by cloud-init (gpucloud agent_bootstrap).\n"
        "[Unit]\n"
        "Description=GPUasService node agent\n"
        "Wants=network-online.target\n"
        "After=network-online.target\n"
        f"ConditionPathExists={AGENT_CONFIG_PATH}\n"
        "\n"
        "[Service]\n"
        "Type=simple\n"
        f"Environment=GPUCLOUD_AGENT_CONFIG={AGENT_CONFIG_PATH}\n"
        f"{env}"
        f"ExecStart={AGENT_EXEC}\n"
        "Restart=always\n"
        "RestartSec=10\n"
        # A config the agent cannot start with stays failed (visible) instead of looping.
        f"RestartPreventExitStatus={AGENT_CONFIG_EXIT_STATUS}\n"
        "\n"
        "[Install]\n"
        "WantedBy=multi-user.target\n"
    )


def _status_line(layer: str) -> str:
    return f'echo "$rc" > {BOOTSTRAP_STATUS_DIR}/{layer}.status\n'


def render_site_bootstrap_runner() -> str:
    return (
        "#!/bin/sh\n"
        "# Written by cloud-init (gpucloud site_bootstrap): hands the site bundle reference to\n"
        "# the image-provided hook; runs nothing else.\n"
        "set -u\n"
        f"mkdir -p {BOOTSTRAP_STATUS_DIR}\n"
        f"if [ -x {SITE_BOOTSTRAP_HOOK} ]; then\n"
        f"  {SITE_BOOTSTRAP_HOOK} {SITE_BOOTSTRAP_REF_PATH}; rc=$?\n"
        "else\n"
        f'  echo "gpucloud: {SITE_BOOTSTRAP_HOOK} is missing" >&2; rc=127\n'
        "fi\n" + _status_line(LAYER_SITE_BOOTSTRAP) + 'exit "$rc"\n'
    )


def render_agent_install_script() -> str:
    return (
        "#!/bin/sh\n"
        "# Written by cloud-init (gpucloud agent_bootstrap): installs the agent package whose\n"
        f"# https URL is in {AGENT_PACKAGE_URL_PATH}.\n"
        "set -eu\n"
        f'url="$(cat {AGENT_PACKAGE_URL_PATH})"\n'
        "mkdir -p /var/cache/gpucloud\n"
        'curl -fsSL --proto =https --retry 5 -o /var/cache/gpucloud/gpucloud-agent.deb "$url"\n'
        "DEBIAN_FRONTEND=noninteractive apt-get install -y /var/cache/gpucloud/gpucloud-agent.deb\n"
    )


def render_share_disks_script() -> str:
    return (
        "#!/bin/bash\n"
        "# Written by cloud-init (gpucloud share_disks). DESTRUCTIVE: wipes every disk listed in\n"
        f"# {SHARE_DISKS_LIST_PATH} and mounts it as /shareN. Refuses the root disk and any disk\n"
        "# with a mounted filesystem. Runs once.\n"
        "set -euo pipefail\n"
        "marker=/var/lib/gpucloud/share-disks.done\n"
        '[ -e "$marker" ] && exit 0\n'
        'root_src="$(findmnt -no SOURCE /)"\n'
        "# every disk under / (a partition, LVM or RAID on several disks)\n"
        'root_disks="$(lsblk -lnpso NAME,TYPE "$root_src" | awk \'$2=="disk"{print $1}\')"\n'
        '[ -n "$root_disks" ] || { echo "gpucloud: cannot find the root disk" >&2; exit 1; }\n'
        "n=0\n"
        "while IFS= read -r listed; do\n"
        '  [ -n "$listed" ] || continue\n'
        '  disk="$(readlink -f "$listed")"\n'
        '  if [ "$(lsblk -ndo TYPE "$disk")" != disk ]; then\n'
        '    echo "gpucloud: $listed is not a disk" >&2; exit 1\n'
        "  fi\n"
        '  if printf "%s\\n" "$root_disks" | grep -qxF "$disk"; then\n'
        '    echo "gpucloud: refusing to initialise the root disk $listed" >&2; exit 1\n'
        "  fi\n"
        '  if [ -n "$(lsblk -nro MOUNTPOINT "$disk" | tr -d \'[:space:]\')" ]; then\n'
        '    echo "gpucloud: refusing $listed: it has a mounted filesystem" >&2; exit 1\n'
        "  fi\n"
        "done < " + SHARE_DISKS_LIST_PATH + "\n"
        "while IFS= read -r listed; do\n"
        '  [ -n "$listed" ] || continue\n'
        '  disk="$(readlink -f "$listed")"\n'
        '  wipefs -a "$disk"\n'
        '  parted -s "$disk" mklabel gpt mkpart "share$n" ext4 0% 100%\n'
        "  udevadm settle\n"
        '  part="$(lsblk -lnpo NAME,TYPE "$disk" | awk \'$2=="part"{print $1; exit}\')"\n'
        '  mkfs.ext4 -F -L "share$n" "$part"\n'
        '  mkdir -p "/share$n"\n'
        '  uuid="$(blkid -s UUID -o value "$part")"\n'
        '  echo "UUID=$uuid /share$n ext4 defaults,nofail 0 2" >> /etc/fstab\n'
        '  mount "/share$n"\n'
        "  n=$((n + 1))\n"
        "done < " + SHARE_DISKS_LIST_PATH + "\n"
        'mkdir -p "$(dirname "$marker")" && touch "$marker"\n'
    )


def roce_commands(routes: Sequence[_Route]) -> list[str]:
    lines: list[str] = []
    for r in routes:
        dev, src = shlex.quote(r.interface), str(r.address.ip)
        net, gw, table, prio = str(r.address.network), str(r.gateway), r.table, r.priority
        lines += [
            f"ip route replace {net} dev {dev} src {src} table {table}",
            f"ip route replace default via {gw} dev {dev} table {table}",
            f"ip rule del priority {prio} 2>/dev/null || true",
            f"ip rule add from {src}/32 table {table} priority {prio}",
        ]
    return lines


def render_roce_script(assignments: Sequence[RoceAssignment]) -> str:
    """The RoCE policy-routing script (validates the assignments; raises CloudInitError)."""
    routes = _roce_routes(assignments)
    return (
        "#!/bin/sh\n"
        "# Written by cloud-init (gpucloud roce_routing): policy routing per RoCE interface,\n"
        "# generated from the site's RoCE assignments. Idempotent.\n"
        "set -eu\n" + "".join(line + "\n" for line in roce_commands(routes))
    )


def render_roce_unit() -> str:
    return (
        "# Written by cloud-init (gpucloud roce_routing).\n"
        "[Unit]\n"
        "Description=GPUasService RoCE policy routing\n"
        "Wants=network-online.target\n"
        "After=network-online.target\n"
        "\n"
        "[Service]\n"
        "Type=oneshot\n"
        "RemainAfterExit=yes\n"
        f"ExecStart={ROCE_SCRIPT}\n"
        "\n"
        "[Install]\n"
        "WantedBy=multi-user.target\n"
    )


def _file(path: str, content: str, permissions: str = "0644") -> dict[str, str]:
    return {"path": path, "content": content, "owner": "root:root", "permissions": permissions}


def render_cloud_init(spec: CloudInitInput) -> RenderedCloudInit:
    """Validate `spec` and compose the versioned #cloud-config. Raises CloudInitError."""
    minutes, routes = _validate(spec)
    site, node, agent = spec.site, spec.node, spec.agent
    layers: list[str] = []
    write_files: list[dict[str, str]] = []
    runcmd: list[list[str]] = [["systemctl", "daemon-reload"]]
    doc: dict[str, object] = {}

    # 1. site bootstrap: a reference and a fixed runner; no inline shell from the API.
    if site.site_bootstrap_bundle_ref is not None or site.upstream_dns_servers:
        layers.append(LAYER_SITE_BOOTSTRAP)
    if site.site_bootstrap_bundle_ref is not None:
        write_files += [
            _file(SITE_BOOTSTRAP_REF_PATH, site.site_bootstrap_bundle_ref + "\n"),
            _file(SITE_BOOTSTRAP_RUNNER, render_site_bootstrap_runner(), "0755"),
        ]
        runcmd.append([SITE_BOOTSTRAP_RUNNER])
    if site.upstream_dns_servers:
        dns = " ".join(site.upstream_dns_servers)
        write_files.append(
            _file(
                RESOLVED_DROPIN_PATH, f"# Written by cloud-init (gpucloud).\n[Resolve]\nDNS={dns}\n"
            )
        )
        runcmd.append(["systemctl", "try-restart", "systemd-resolved.service"])

    # 2. deploy user
    layers.append(LAYER_DEPLOY_USER)
    user = site.deploy_user
    entry: dict[str, object] = {
        "name": user.name,
        "lock_passwd": False,
        "passwd": user.password_hash,
        "shell": "/bin/bash",
    }
    if user.sudo:
        entry["sudo"] = "ALL=(ALL) ALL"
    if user.ssh_authorized_keys:
        entry["ssh_authorized_keys"] = list(user.ssh_authorized_keys)
    doc["users"] = ["default", entry]

    # 3. node-agent bootstrap
    layers.append(LAYER_AGENT_BOOTSTRAP)
    if agent.ca_bundle_pem is not None:
        doc["ca_certs"] = {"trusted": [agent.ca_bundle_pem.strip() + "\n"]}
    write_files += [
        _file(AGENT_CONFIG_PATH, render_agent_toml(agent), "0600"),
        _file(AGENT_UNIT_PATH, render_agent_unit(ca_bundle=agent.ca_bundle_pem is not None)),
        _file(
            NODE_INFO_PATH,
            json.dumps(
                {
                    "hostname": node.hostname,
                    "maas_system_id": node.maas_system_id,
                    "site": site.name,
                    "cloud_init_format": CLOUD_INIT_FORMAT,
                },
                sort_keys=True,
            )
            + "\n",
        ),
    ]
    if agent.agent_package_url is not None:
        write_files += [
            _file(AGENT_PACKAGE_URL_PATH, agent.agent_package_url + "\n"),
            _file(AGENT_INSTALL_SCRIPT, render_agent_install_script(), "0755"),
        ]

    # 4. MAAS hardware sync (§9.1: required)
    layers.append(LAYER_HARDWARE_SYNC)
    write_files += [
        _file(HW_SYNC.service_unit, render_hw_sync_service(HW_SYNC)),
        _file(HW_SYNC.timer_unit, render_hw_sync_timer(HW_SYNC, minutes)),
    ]
    if spec.maas_machine_token is not None:
        creds = render_machine_creds(node, spec.maas_machine_token)
        write_files.append(_file(HW_SYNC.credentials, creds, "0600"))

    # 5. destructive /shareN initialisation: explicit only
    if spec.share_disks:
        layers.append(LAYER_SHARE_DISKS)
        write_files += [
            _file(SHARE_DISKS_LIST_PATH, "".join(d + "\n" for d in spec.share_disks)),
            _file(SHARE_DISKS_SCRIPT, render_share_disks_script(), "0700"),
        ]
        runcmd.append([SHARE_DISKS_SCRIPT])

    # 6. RoCE routing
    if routes:
        layers.append(LAYER_ROCE_ROUTING)
        write_files += [
            _file(ROCE_SCRIPT, render_roce_script(spec.roce), "0755"),
            _file(ROCE_UNIT_PATH, render_roce_unit()),
        ]
        runcmd.append(["systemctl", "enable", "--now", ROCE_UNIT])

    # 7. runcmd: install, enable and start, in order
    layers.append(LAYER_RUNCMD)
    if agent.agent_package_url is not None:
        runcmd.append([AGENT_INSTALL_SCRIPT])
    if spec.maas_machine_token is not None:  # without credentials the seed step starts it
        runcmd.append(["systemctl", "enable", "--now", PurePosixPath(HW_SYNC.timer_unit).name])
    runcmd.append(["systemctl", "enable", "--now", AGENT_UNIT])

    doc["write_files"] = write_files
    doc["runcmd"] = runcmd
    body = json.dumps(doc, indent=2, ensure_ascii=True)
    content = HEADER + body + "\n"
    digest = hashlib.sha256(content.encode()).hexdigest()
    return RenderedCloudInit(
        content=content, version=f"{CLOUD_INIT_FORMAT}/{digest}", layers=tuple(layers)
    )


# ----------------------------------------------------------------------------- password hashing

_CRYPT_ALPHABET = "./0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


def new_salt(length: int = 16) -> str:
    return "".join(secrets.choice(_CRYPT_ALPHABET) for _ in range(length))


def sha512_crypt(password: str, salt: str, rounds: int = 5000) -> str:
    """SHA-512 crypt ($6$), Drepper's specification; what cloud-init's hashed_passwd takes."""
    if not re.fullmatch(r"[./A-Za-z0-9]{1,16}", salt):
        raise CloudInitError("salt: 1..16 characters of [./A-Za-z0-9]")
    if not 1000 <= rounds <= 999_999_999:
        raise CloudInitError("rounds: must be within 1000..999999999")
    key, s = password.encode(), salt.encode()

    b = hashlib.sha512(key + s + key).digest()
    a = hashlib.sha512(key + s)
    n = len(key)
    while n > 64:
        a.update(b)
        n -= 64
    a.update(b[:n])
    n = len(key)
    while n:
        a.update(b if n & 1 else key)
        n >>= 1
    da = a.digest()

    dp_h = hashlib.sha512(key * len(key)).digest()
    p = (dp_h * (len(key) // 64 + 1))[: len(key)]
    ds_h = hashlib.sha512(s * (16 + da[0])).digest()
    sb = (ds_h * (len(s) // 64 + 1))[: len(s)]

    c = da
    for i in range(rounds):
        h = hashlib.sha512()
        h.update(p if i & 1 else c)
        if i % 3:
            h.update(sb)
        if i % 7:
            h.update(p)
        h.update(c if i & 1 else p)
        c = h.digest()

    order = [
        (0, 21, 42), (22, 43, 1), (44, 2, 23), (3, 24, 45), (25, 46, 4), (47, 5, 26),
        (6, 27, 48), (28, 49, 7), (50, 8, 29), (9, 30, 51), (31, 52, 10), (53, 11, 32),
        (12, 33, 54), (34, 55, 13), (56, 14, 35), (15, 36, 57), (37, 58, 16), (59, 17, 38),
        (18, 39, 60), (40, 61, 19), (62, 20, 41),
    ]  # fmt: skip
    out: list[str] = []

    def b64(v: int, count: int) -> None:
        for _ in range(count):
            out.append(_CRYPT_ALPHABET[v & 0x3F])
            v >>= 6

    for x, y, z in order:
        b64((c[x] << 16) | (c[y] << 8) | c[z], 4)
    b64(c[63], 2)
    prefix = "$6$" if rounds == 5000 else f"$6$rounds={rounds}$"
    return f"{prefix}{salt}${''.join(out)}"


def hash_deploy_password(password: str, salt: str | None = None) -> str:
    """Hash once (from Vault) and pass the result as DeployUser.password_hash."""
    return sha512_crypt(password, salt if salt is not None else new_salt())
