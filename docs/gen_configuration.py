"""The configuration reference, generated from the settings classes.

docs/configuration.md carries the tables between the markers

    <!-- generated:configuration:NAME -->
    ...
    <!-- /generated -->

and tests/test_docs.py fails when a block differs from what this module prints now. The
settings classes' fields name their variable, the processes that read it and what it means
(`core.config.env` metadata); the default shown is what the class's `from_env({})` gives, so it
is the code's own. Variables read outside a settings class (by an argument parser, a plugin, the
agent, the simulators, `bin/stack`) are listed below in `OTHER_VARIABLES`, and the test also
fails when the code names a `GPUCLOUD_*` variable that is in neither table nor in `INTERNAL`:

    .venv/bin/python docs/gen_configuration.py            # every table
    .venv/bin/python docs/gen_configuration.py --write    # rewrite the blocks in docs/
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGE = DOCS / "configuration.md"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BEGIN = "<!-- generated:configuration:{name} -->"
END = "<!-- /generated -->"
BLOCK_RE = re.compile(
    r"<!-- generated:configuration:(?P<name>[a-z0-9_-]+) -->\n(?P<body>.*?)<!-- /generated -->",
    re.DOTALL,
)
# A variable's name as the code spells it (not a prefix such as `GPUCLOUD_SIM_*`).
VARIABLE_RE = re.compile(r"\bGPUCLOUD_[A-Z0-9_]*[A-Z0-9]\b")


@dataclass(frozen=True)
class Row:
    variable: str
    type: str
    default: str
    read_by: str
    meaning: str


def settings_classes() -> dict[str, type[Any]]:
    """Each table's name and the settings class it is drawn from."""
    from core.config import Settings
    from core.payment_settings import NotificationSettings, PaymentSettings
    from gateway.config import GatewayConfig

    return {
        "settings": Settings,
        "gateway": GatewayConfig,
        "payments": PaymentSettings,
        "notifications": NotificationSettings,
    }


def _shown(value: object) -> str:
    if value is None or value == "" or value == ():
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"`{value}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def rows_of(cls: type[Any]) -> list[Row]:
    """One row per field that is read from a variable, in the class's order."""
    from core.config import ENV_METADATA

    defaults = cls.from_env({})
    rows = []
    for f in dataclasses.fields(cls):
        meta = f.metadata.get(ENV_METADATA)
        if meta is None:
            continue
        default = meta.default if meta.default is not None else _shown(getattr(defaults, f.name))
        rows.append(Row(meta.name, f"`{f.type}`", default, meta.read_by, meta.meaning))
    return rows


# Read outside a settings class: (variable, default, read by, meaning). Keep them here, one line
# each; the test fails when one is no longer named by the code.
OTHER_VARIABLES: tuple[tuple[str, str, str, str], ...] = (
    (
        "GPUCLOUD_STORAGE_ROOT",
        "`/srv/gpucloud-storage` (`.state/storage` under `bin/stack`)",
        "worker, simulated fleet",
        "the shared-directory storage provider's tree (namespaces and grants); a node's agent "
        "sees it at `[storage] export_root`",
    ),
    (
        "GPUCLOUD_HOST_ACCESS",
        "`real` (`simulated` under `bin/stack`)",
        "worker",
        "how onboarding reaches machines outside MAAS: `real` = `ipmitool` for BMC power cycles "
        "and SSH (the site's deploy user) for the hardware-sync seed; another name = a plugin "
        "(entry point `gpucloud.host_access`; `simulated`: `sim/host_access.py`)",
    ),
    (
        "GPUCLOUD_SIM_MAAS_URL",
        "set by `bin/stack`",
        "worker (simulated host access), simulator's ipmitool",
        "the MAAS simulator (`http://HOST:PORT/MAAS`)",
    ),
    (
        "GPUCLOUD_SIM_MAAS_CONTROL_TOKEN",
        "set by `bin/stack`",
        "worker (simulated host access), simulators",
        "the MAAS simulator's control-API token",
    ),
    (
        "GPUCLOUD_SIM_MACHINES_DIR",
        "`.state/machines`",
        "worker (simulated host access)",
        "the simulated machines' disks, where an SSH config push is written",
    ),
    (
        "GPUCLOUD_AGENT_CONFIG",
        "`/etc/gpucloud/agent.toml`",
        "agent",
        "the agent's config file (API URL, enrollment token, state dir, payload key file)",
    ),
    (
        "GPUCLOUD_AGENT_ROOT",
        "`/`",
        "agent",
        "the directory standing for the host's `/` (the simulated machines' disks)",
    ),
    (
        "GPUCLOUD_AGENT_HEARTBEAT_S",
        "`30`",
        "agent, simulated fleet",
        "how often the agent reads its GPU inventory (a change is signalled at once; otherwise "
        "a presence signal every half hour)",
    ),
    (
        "GPUCLOUD_SIM_PHASE_DELAY_S",
        "`0` (`1` under `bin/stack`)",
        "simulated fleet, `bin/stack`",
        'seconds per simulated host phase, or `{"default": 1, "guest_reachable": 5}`',
    ),
    (
        "GPUCLOUD_SIM_PHASE_JITTER",
        "`0` (`0.2` under `bin/stack`)",
        "simulated fleet, `bin/stack`",
        "± fraction applied to each phase delay",
    ),
    (
        "GPUCLOUD_SIM_FAULTS",
        "none",
        "simulated fleet",
        "JSON list of faults (`sim/faults.py`)",
    ),
    (
        "GPUCLOUD_SIM_CONFIG",
        "none",
        "simulated fleet",
        "one JSON document with all simulator settings and per-node overrides (`sim/config.py`)",
    ),
    (
        "GPUCLOUD_SIM_HOSTS",
        "`simulated`",
        "simulated fleet",
        "the fleet's hosts: `simulated`, or real backends on libvirt's test driver "
        "(`libvirt-test`)",
    ),
    (
        "GPUCLOUD_PG_PORT",
        "`55432`",
        "`bin/stack`",
        "the embedded stack's PostgreSQL port",
    ),
    ("GPUCLOUD_TEMPORAL_PORT", "`7233`", "`bin/stack`", "the embedded Temporal's gRPC port"),
    (
        "GPUCLOUD_TEMPORAL_UI_PORT",
        "`8233`",
        "`bin/stack`",
        "Temporal Web's private port on 127.0.0.1 (operators open it at the gateway's "
        "`/temporal/`)",
    ),
    ("GPUCLOUD_VAULT_PORT", "`8200`", "`bin/stack`", "the Vault simulator's port"),
    ("GPUCLOUD_MAAS_SIM_PORT", "`5240`", "`bin/stack`", "the MAAS simulator's port"),
    (
        "GPUCLOUD_STRIPE_MOCK_PORT",
        "`12111`",
        "`bin/stack`",
        "stripe-mock's HTTP port; HTTPS takes the next",
    ),
    (
        "GPUCLOUD_WORKER_METRICS_PORT",
        "`9464`",
        "`bin/stack`",
        "where the stack's worker serves its Temporal SDK metrics",
    ),
    (
        "GPUCLOUD_STATE_DIR",
        "`.state`",
        "`bin/stack`",
        "where the embedded stack keeps its state (PostgreSQL data, history, tokens, logs)",
    ),
    (
        "GPUCLOUD_STACK_HOSTS",
        "`simulated`",
        "`bin/stack`",
        "the fleet's hosts: `simulated` or `libvirt-test` (`--hosts`)",
    ),
    (
        "GPUCLOUD_STACK_VAULT",
        "`simulator`",
        "`bin/stack`",
        "`simulator` (our Vault-compatible store) or `hashicorp` (HashiCorp Vault itself)",
    ),
    (
        "GPUCLOUD_STACK_TEMPORAL",
        "`dev`",
        "`bin/stack`",
        "`dev` (the dev server on SQLite) or `cluster` (the Temporal server on the stack's "
        "PostgreSQL)",
    ),
    (
        "GPUCLOUD_TOOLS_DIR",
        "`~/.cache/gpucloud/tools`",
        "`bin/bootstrap`, `bin/stack`, CI",
        "where the built `temporal` CLI (and other Go tools) live",
    ),
    (
        "GPUCLOUD_API",
        "`http://127.0.0.1:8000`",
        "`gpucloud-terminal`, `gpucloud-onboard`, `devstack.smoke`",
        "the gateway's base URL for the command-line clients (`.state/env` exports it)",
    ),
    (
        "GPUCLOUD_API_URL",
        "`GPUCLOUD_API`",
        "`gpucloud-onboard`",
        "the gateway's base URL, winning over `GPUCLOUD_API`",
    ),
    (
        "GPUCLOUD_API_TOKEN",
        "`ADMIN_TOKEN`",
        "`gpucloud-onboard`",
        "the admin token (sent only as the bearer header)",
    ),
    (
        "GPUCLOUD_TOKEN",
        "`TENANT_TOKEN`",
        "`gpucloud-terminal`",
        "the tenant token",
    ),
    (
        "GPUCLOUD_CODEC_ENDPOINT",
        "`http://localhost:8000/api/v1/admin/codec`",
        "`docker-compose.temporal.yml`",
        "the codec endpoint Temporal Web's browser calls",
    ),
)

# Named by the code but not settings an operator sets: test and CI hooks (docs/testing.md),
# and the names of variables the code writes for a child process.
INTERNAL: dict[str, str] = {
    "GPUCLOUD_NODE_DRAIN_POLL_S": "how often a drain looks again; tests shorten it",
    "GPUCLOUD_SIM_MAX_RUNNING_AGENTS": "a cap on simulated agent processes; tests set it",
    "GPUCLOUD_REQUIRE_ROOT": "CI: a root-only test that skips fails instead",
    "GPUCLOUD_TEST_SERIAL": "bin/test",
    "GPUCLOUD_TEST_WORKERS": "bin/test",
    "GPUCLOUD_TEST_TIMEOUT_S": "bin/test",
    "GPUCLOUD_TEST_TEMPORAL": "bin/test's cluster tier",
    "GPUCLOUD_SAFETY_EXAMPLES": "bench/safety_fuzz.sh",
    "GPUCLOUD_SAFETY_STEPS": "bench/safety_fuzz.sh",
    "GPUCLOUD_SAFETY_SHRINK": "bench/safety_fuzz.sh",
}


def other_rows() -> list[Row]:
    return [Row(name, "", default, by, meaning) for name, default, by, meaning in OTHER_VARIABLES]


def render(name: str) -> str:
    """The Markdown between a block's markers, ending in a newline."""
    if name == "other":
        header = ["| variable | default | read by | meaning |", "|---|---|---|---|"]
        lines = [
            f"| `{r.variable}` | {_cell(r.default)} | {_cell(r.read_by)} | {_cell(r.meaning)} |"
            for r in other_rows()
        ]
        return "\n".join(header + lines) + "\n"
    cls = settings_classes()[name]
    header = [
        f"`{cls.__module__}.{cls.__qualname__}`:",
        "",
        "| variable | type | default | read by | meaning |",
        "|---|---|---|---|---|",
    ]
    lines = [
        # A pipe inside a code span is no cell border, and an escape there would be shown.
        f"| `{r.variable}` | {r.type} | {_cell(r.default)} | {_cell(r.read_by)} | "
        f"{_cell(r.meaning)} |"
        for r in rows_of(cls)
    ]
    return "\n".join(header + lines) + "\n"


def names() -> list[str]:
    return [*settings_classes(), "other"]


def documented() -> set[str]:
    """Every variable the reference lists."""
    found = {r.variable for cls in settings_classes().values() for r in rows_of(cls)}
    return found | {r.variable for r in other_rows()}


def _code_files(root: Path = ROOT) -> Iterator[Path]:
    """The files whose variables count: the code and its scripts, not the tests or the docs."""
    skip = {
        ".git",
        ".venv",
        ".state",
        "tests",
        "docs",
        "node_modules",
        "__pycache__",
        "build",
        "dist",
    }
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if not path.is_file() or skip & set(rel.parts) or rel.parts[0].endswith(".egg-info"):
            continue
        if path.suffix in {".py", ".sh", ".yml", ".yaml", ".toml"} or rel.parts[0] in {
            "bin",
            ".ci",
        }:
            yield path


def variables_in_code(root: Path = ROOT) -> dict[str, list[str]]:
    """Every GPUCLOUD_* variable the code names, with the files naming it."""
    found: dict[str, list[str]] = {}
    for path in _code_files(root):
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for name in sorted(set(VARIABLE_RE.findall(text))):
            found.setdefault(name, []).append(str(path.relative_to(root)))
    return found


def block(name: str) -> str:
    return f"{BEGIN.format(name=name)}\n{render(name)}{END}"


def blocks_in(text: str) -> list[tuple[str, str]]:
    return [(m["name"], m["body"]) for m in BLOCK_RE.finditer(text)]


def write(page: Path = PAGE) -> bool:
    """Rewrite every generated block of the page; True when it changed."""
    text = page.read_text()
    new = BLOCK_RE.sub(lambda m: block(m["name"]), text)
    if new != text:
        page.write_text(new)
    return new != text


def main(argv: list[str]) -> int:
    if argv == ["--write"]:
        if write():
            print(f"rewrote {PAGE.relative_to(ROOT)}")
        return 0
    for name in names():
        print(block(name))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
