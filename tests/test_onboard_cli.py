"""`gpucloud-onboard`: the CSV checks (in process, no network), and the real process against the
gateway served by uvicorn on a free port (real PostgreSQL and Temporal; the worker part that runs
submissions, but no onboarding worker, so the submitted workflows stay queued and the tests move
the rows themselves)."""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from sqlalchemy import select, update

from contracts.states import SkuShape
from devstack.processes import free_port
from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.onboard_cli import CliError, CsvNode, main, read_csv
from schema.models import NodeOnboarding
from tests.admin_operation_support import admin_operations_worker
from tests.factories import create_sku
from tests.gateway_fixtures import TEMPORAL_UI_ORIGIN
from tests.lifecycle_support import eventually, server_started

SKU = "h100.8x.baremetal"
REGION = "us-east-1"


def write(tmp_path: Path, text: str, name: str = "nodes.csv") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --- the CSV, checked before anything is sent --------------------------------------------------


def test_header_driven_csv_is_read_in_any_column_order(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "\ufeffipmi_ip , Hostname\n10.176.16.128,c07u43\n\n  2001:DB8::10 ,  c07u44 \n",
    )
    assert read_csv(path) == [
        CsvNode(2, "c07u43", "10.176.16.128"),
        CsvNode(4, "c07u44", "2001:db8::10"),
    ]


def test_every_bad_row_is_reported_and_nothing_is_sent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(
        tmp_path,
        "hostname,ipmi_ip\n"
        "c07u43,10.176.16.128\n"  # 2: fine
        "C07U44,10.176.16.129\n"  # 3: upper case
        "c07u45,10.176.16.300\n"  # 4: not an address
        "c07u43,10.176.16.131\n"  # 5: repeats line 2
        "c07u47,10.176.16.128\n"  # 6: repeats line 2's BMC
        "c07u48\n"  # 7: one value
        "c07u49,10.0.0.1/24\n",  # 8: a prefix
    )
    # No token and no server: the checks come first, so neither is needed.
    code = main(["import", str(path), "--site", str(uuid.uuid4()), "--profile",
                 str(uuid.uuid4()), "--sku", SKU, "--api-url", "http://127.0.0.1:9"])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    for line in (3, 4, 5, 6, 7, 8):
        assert f"nodes.csv:{line}:" in err, err
    assert "nodes.csv:2:" not in err
    assert "repeats line 2" in err
    assert "6 problem(s); nothing was submitted" in err


def test_each_problem_is_one_line_however_long_the_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The report is grepped and copied: a path longer than the terminal is wide used to be
    wrapped mid-name ("nodes.c" / "sv:3:")."""
    deep = tmp_path / ("a-long-operator-directory-name-" * 4)
    deep.mkdir()
    path = write(deep, "hostname,ipmi_ip\nC07U44,10.176.16.129\nc07u45,10.176.16.300\n")
    code = main(["import", str(path), "--site", str(uuid.uuid4()), "--profile",
                 str(uuid.uuid4()), "--sku", SKU, "--api-url", "http://127.0.0.1:9"])  # fmt: skip
    assert code == 2
    lines = capsys.readouterr().err.splitlines()
    assert [line.startswith(f"{path}:{n}: ") for n, line in zip((2, 3), lines, strict=False)] == [
        True,
        True,
    ], lines


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("c07u43,10.176.16.128\nc07u44,10.176.16.129\n", "no header row. Legacy positional CSV"),
        ("hostname,ipmi_ip,rack\nc07u43,10.0.0.1,r7\n", "unknown column(s) 'rack'"),
        ("hostname\nc07u43\n", "missing column(s) ipmi_ip"),
        ("hostname,ipmi_ip,hostname\n", "repeated column(s) hostname"),
        ("", "empty"),
        ("hostname,ipmi_ip\n\n", "no nodes after the header"),
        (
            "hostname,ipmi_ip\n"
            + "".join(f"n{i},10.1.{i // 250}.{i % 250 + 1}\n" for i in range(501)),
            "at most 500",
        ),
    ],
)
def test_file_level_errors(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(CliError) as raised:
        read_csv(write(tmp_path, text))
    assert expected in str(raised.value)
    assert raised.value.status == 2


def test_missing_token_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("GPUCLOUD_API_TOKEN", "ADMIN_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    path = write(tmp_path, "hostname,ipmi_ip\nc07u43,10.176.16.128\n")
    code = main(["import", str(path), "--site", str(uuid.uuid4()), "--profile",
                 str(uuid.uuid4()), "--sku", SKU])  # fmt: skip
    assert code == 2
    assert "no admin token" in capsys.readouterr().err


# --- against the gateway over HTTP -------------------------------------------------------------


@pytest.fixture
async def submissions_worker(
    settings: Any, temporal_client: Any, db_engine: Any
) -> AsyncIterator[None]:
    """What the worker runs for the gateway (AdminOperationWorkflow): the submissions."""
    async with admin_operations_worker(temporal_client, settings, db_engine):
        yield


@pytest.fixture
async def gateway_url(
    settings: Any, temporal_client: Any, submissions_worker: None
) -> AsyncIterator[str]:
    """The gateway app under uvicorn on a free loopback port, on this test's event loop."""
    app = create_app(
        settings,
        temporal_client=temporal_client,
        config=GatewayConfig(temporal_ui_origin=TEMPORAL_UI_ORIGIN),
    )
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    task = asyncio.create_task(server.serve())
    await server_started(server, task, timeout=10)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, timeout=15)


@pytest.fixture
async def site(api: Any, make_token: Any, db_sessions: Any) -> dict[str, Any]:
    await create_sku(db_sessions, SKU, shape=SkuShape.BAREMETAL, region=REGION, allowed=(8,))
    admin = await api(token=await make_token("admin"))
    response = await admin.post(
        "/api/v1/admin/maas-sites",
        json={
            "name": f"dc-{uuid.uuid4().hex[:6]}",
            "region_code": REGION,
            "api_base_url": "http://127.0.0.1:9/MAAS",
            "pxe_iface": "ens19",
            "pxe_vlan_vid": 46,
            "node_pxe_iface": "eno8303",
        },
    )
    assert response.status_code == 201, response.text
    created: dict[str, Any] = response.json()
    return created


async def onboard_cli(
    url: str, token: str, *args: str, printed: list[str] | None = None
) -> tuple[int, str, str]:
    """The CLI as a process; each line it prints goes into `printed` as it comes (unbuffered),
    for a test that waits on what it has shown so far."""
    env = {**os.environ, "GPUCLOUD_API_URL": url, "GPUCLOUD_API_TOKEN": token,
           "PYTHONUNBUFFERED": "1"}  # fmt: skip
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.onboard_cli", *args,
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert process.stdout is not None
    assert process.stderr is not None
    lines = printed if printed is not None else []

    async def read_out() -> None:
        assert process.stdout is not None
        async for line in process.stdout:
            lines.append(line.decode())

    _, err, _ = await asyncio.wait_for(
        asyncio.gather(read_out(), process.stderr.read(), process.wait()), timeout=60
    )
    assert process.returncode is not None
    return process.returncode, "".join(lines), err.decode()


def import_args(path: Path, site: dict[str, Any], *extra: str) -> list[str]:
    return ["import", str(path), "--site", site["id"], "--profile", site["default_profile_id"],
            "--sku", SKU, *extra]  # fmt: skip


async def test_import_no_wait_submits_the_batch(
    gateway_url: str, site: dict[str, Any], make_token: Any, db_sessions: Any, tmp_path: Path
) -> None:
    token = await make_token("admin")
    path = write(tmp_path, "hostname,ipmi_ip\nc07u43,10.176.16.128\nc07u44,10.176.16.129\n")
    code, out, err = await onboard_cli(gateway_url, token, *import_args(path, site, "--no-wait"))
    assert code == 0, err
    async with db_sessions() as session:
        rows = list(await session.scalars(select(NodeOnboarding).order_by(NodeOnboarding.hostname)))
    assert [(r.hostname, str(r.ipmi_ip), r.status) for r in rows] == [
        ("c07u43", "10.176.16.128", "pending"),
        ("c07u44", "10.176.16.129", "pending"),
    ]
    batch_id = str(rows[0].batch_id)
    assert rows[1].batch_id == rows[0].batch_id
    assert f"submitted batch {batch_id}: 2 node(s)" in out
    assert str(rows[0].onboarding_id) in out
    assert token not in out + err

    code, out, err = await onboard_cli(gateway_url, token, "status", batch_id)
    assert code == 0, err
    assert "c07u43" in out
    assert "c07u44" in out
    assert "2 pending" in out

    # The same hostnames again: the API's 409, named per host; nothing new.
    code, out, err = await onboard_cli(gateway_url, token, *import_args(path, site, "--no-wait"))
    assert code == 1
    assert "409 onboarding_in_progress" in err
    assert f"c07u43: onboarding_in_progress {rows[0].onboarding_id}" in err
    # A refusal by the API about the request itself (here the SKU).
    other = write(tmp_path, "hostname,ipmi_ip\nc08u01,10.176.17.1\n", "other.csv")
    args = import_args(other, site, "--no-wait")
    args[args.index("--sku") + 1] = "mi300x.192g.8gpu"
    code, out, err = await onboard_cli(gateway_url, token, *args)
    assert code == 1
    assert "422 unknown_sku" in err
    code, out, err = await onboard_cli(gateway_url, "gpc_not-a-token", *args)
    assert code == 1
    assert "401 unauthenticated" in err
    async with db_sessions() as session:
        assert len(list(await session.scalars(select(NodeOnboarding)))) == 2


async def settle(
    db_sessions: Any, outcome: dict[str, tuple[str, str | None]], printed: list[str]
) -> None:
    """Once the CLI's batch is in, move its rows as a workflow would: running, then (once the
    CLI has shown every node running) settled."""
    hostnames = list(outcome)

    async def arrived() -> bool:
        async with db_sessions() as session:
            found = list(
                await session.scalars(
                    select(NodeOnboarding.hostname).where(NodeOnboarding.hostname.in_(hostnames))
                )
            )
        return len(found) == len(hostnames)

    await eventually(arrived)
    async with db_sessions() as session, session.begin():
        await session.execute(
            update(NodeOnboarding)
            .where(NodeOnboarding.hostname.in_(hostnames))
            .values(status="running", current_stage="commission_node")
        )

    async def shown_running() -> bool:
        text = "".join(printed)
        return all(f"{h}: running at commission_node" in text for h in hostnames)

    await eventually(shown_running)
    async with db_sessions() as session, session.begin():
        for hostname, (status, failure_class) in outcome.items():
            await session.execute(
                update(NodeOnboarding)
                .where(NodeOnboarding.hostname == hostname)
                .values(
                    status=status,
                    failure_class=failure_class,
                    recommended_action="retry" if failure_class else None,
                )
            )


async def test_import_waits_until_every_node_settles(
    gateway_url: str, site: dict[str, Any], make_token: Any, db_sessions: Any, tmp_path: Path
) -> None:
    token = await make_token("admin")
    path = write(tmp_path, "hostname,ipmi_ip\nw1,10.0.0.1\nw2,10.0.0.2\n")
    args = import_args(path, site, "--poll-interval", "0.1")
    printed: list[str] = []
    cli = asyncio.create_task(onboard_cli(gateway_url, token, *args, printed=printed))
    await settle(db_sessions, {"w1": ("completed", None), "w2": ("reconciled", None)}, printed)
    code, out, err = await cli
    assert code == 0, out + err
    assert "w1: running at commission_node" in out  # not a terminal: one line per change
    assert "2 node(s): 1 completed, 1 reconciled" in out

    path = write(tmp_path, "hostname,ipmi_ip\nf1,10.0.1.1\nf2,10.0.1.2\n", "failing.csv")
    printed = []
    cli = asyncio.create_task(
        onboard_cli(
            gateway_url, token, *import_args(path, site, "--poll-interval", "0.1"), printed=printed
        )
    )
    await settle(
        db_sessions,
        {"f1": ("completed", None), "f2": ("failed_retryable", "bmc_power_failure")},
        printed,
    )
    code, out, err = await cli
    assert code == 1, out + err
    assert "f2: failed_retryable at commission_node (bmc_power_failure)" in out
    assert "recommended: retry" in out
