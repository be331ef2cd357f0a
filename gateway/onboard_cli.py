"""`gpucloud-onboard`: submit a CSV of MAAS nodes as one onboarding batch and watch it.

    gpucloud-onboard import nodes.csv --site SITE_ID --profile PROFILE_ID --sku h100.8x.baremetal
    gpucloud-onboard import nodes.csv ... --no-wait       # submit, print the ids, exit
    gpucloud-onboard status BATCH_ID                      # one look at a batch

The CSV has a header row naming exactly the columns `hostname` and `ipmi_ip` (any order); legacy
positional files without a header are refused (docs/lifecycles/onboarding.md#submitting: the API is
JSON only, the CSV belongs to this tool). Every row is checked here first, with the rules the API
applies; if any row is bad, all bad rows are listed with their line numbers, nothing is submitted,
and the exit status is 2. Otherwise the rows go to `POST /api/v1/admin/onboardings/batch` and,
unless `--no-wait`, a per-node table (hostname, stage, status, failure class, recommended action) is
refreshed by polling `GET /api/v1/admin/onboardings?batch_id=` until every node has settled
(completed, reconciled, cancelled or failed_*). Exit status: 0 when every node completed (or was
reconciled), 1 otherwise (or when the API refused the batch), 2 for bad input.

The API address comes from --api-url, else GPUCLOUD_API_URL, else GPUCLOUD_API (what
`.state/stack.env` exports), else http://127.0.0.1:8000; the admin token from --token, else
GPUCLOUD_API_TOKEN, else ADMIN_TOKEN. The token is only ever sent as the bearer header.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.live import Live
from rich.table import Table

from gateway.onboarding_schemas import HOSTNAME, HOSTNAME_RULE, MAX_BATCH_NODES, canonical_ip

DEFAULT_API_URL = "http://127.0.0.1:8000"
COLUMNS = ("hostname", "ipmi_ip")
SUCCEEDED = frozenset({"completed", "reconciled"})
SETTLED = SUCCEEDED | {"cancelled", "failed_retryable", "failed_manual_intervention"}
PAGE = 200
NON_TTY_WIDTH = 140

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class CliError(Exception):
    """A problem to report on stderr, with the exit status to leave with."""

    def __init__(self, message: str, status: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.status = status


# --- the CSV ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class CsvNode:
    line: int
    hostname: str
    ipmi_ip: str


def read_csv(path: Path) -> list[CsvNode]:
    """The rows of a header-driven CSV, all checked; CliError (status 2) listing every bad row."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as err:
        raise CliError(f"{path}: cannot read ({type(err).__name__})", EXIT_USAGE) from None
    rows = [(n, [c.strip() for c in cells]) for n, cells in _numbered(text)]
    rows = [(n, cells) for n, cells in rows if any(cells)]
    if not rows:
        raise CliError(f"{path}: empty; expected a header line 'hostname,ipmi_ip'", EXIT_USAGE)
    header_line, header = rows[0]
    columns = [c.lower() for c in header]
    problems: list[str] = []
    if not set(columns) & set(COLUMNS):
        raise CliError(
            f"{path}:{header_line}: no header row. Legacy positional CSV is not supported: "
            "put the line 'hostname,ipmi_ip' first, naming the columns",
            EXIT_USAGE,
        )
    unknown = [c for c in columns if c not in COLUMNS]
    missing = [c for c in COLUMNS if c not in columns]
    repeated = sorted({c for c in columns if columns.count(c) > 1})
    if unknown:
        problems.append(f"unknown column(s) {', '.join(map(repr, unknown))}")
    if missing:
        problems.append(f"missing column(s) {', '.join(missing)}")
    if repeated:
        problems.append(f"repeated column(s) {', '.join(repeated)}")
    if problems:
        raise CliError(
            f"{path}:{header_line}: {'; '.join(problems)}; the columns are exactly "
            "hostname,ipmi_ip",
            EXIT_USAGE,
        )
    position = {c: columns.index(c) for c in COLUMNS}

    nodes: list[CsvNode] = []
    errors: list[str] = []
    seen_host: dict[str, int] = {}
    seen_ip: dict[str, int] = {}
    for line, cells in rows[1:]:
        if len(cells) != len(columns):
            errors.append(f"{path}:{line}: {len(cells)} values, expected {len(columns)}")
            continue
        hostname, raw_ip = cells[position["hostname"]], cells[position["ipmi_ip"]]
        bad = False
        if not HOSTNAME.match(hostname):
            errors.append(f"{path}:{line}: hostname {hostname!r} must be {HOSTNAME_RULE}")
            bad = True
        elif hostname in seen_host:
            errors.append(
                f"{path}:{line}: hostname {hostname!r} repeats line {seen_host[hostname]}"
            )
            bad = True
        ip = canonical_ip(raw_ip)
        if ip is None:
            errors.append(f"{path}:{line}: ipmi_ip {raw_ip!r} is not an IPv4 or IPv6 address")
            bad = True
        elif ip in seen_ip:
            errors.append(f"{path}:{line}: ipmi_ip {raw_ip!r} repeats line {seen_ip[ip]}")
            bad = True
        seen_host.setdefault(hostname, line)
        if ip is not None:
            seen_ip.setdefault(ip, line)
        if not bad and ip is not None:
            nodes.append(CsvNode(line, hostname, ip))
    if errors:
        raise CliError(
            "\n".join([*errors, f"{len(errors)} problem(s); nothing was submitted"]), EXIT_USAGE
        )
    if not nodes:
        raise CliError(f"{path}: no nodes after the header", EXIT_USAGE)
    if len(nodes) > MAX_BATCH_NODES:
        raise CliError(
            f"{path}: {len(nodes)} nodes; a batch takes at most {MAX_BATCH_NODES} (split the file)",
            EXIT_USAGE,
        )
    return nodes


def _numbered(text: str) -> Iterator[tuple[int, list[str]]]:
    reader = csv.reader(text.splitlines())
    for cells in reader:
        yield reader.line_num, cells


# --- the API ---------------------------------------------------------------------------------


def _client(args: argparse.Namespace) -> httpx.Client:
    token = args.token or os.environ.get("GPUCLOUD_API_TOKEN") or os.environ.get("ADMIN_TOKEN")
    if not token:
        raise CliError("no admin token: pass --token or set GPUCLOUD_API_TOKEN", EXIT_USAGE)
    base = (
        args.api_url
        or os.environ.get("GPUCLOUD_API_URL")
        or os.environ.get("GPUCLOUD_API")
        or DEFAULT_API_URL
    )
    return httpx.Client(
        base_url=base.rstrip("/"),
        headers={"Authorization": f"Bearer {token}", "User-Agent": "gpucloud-onboard"},
        timeout=30.0,
    )


def _call(client: httpx.Client, method: str, path: str, **kwargs: Any) -> httpx.Response:
    try:
        return client.request(method, path, **kwargs)
    except httpx.HTTPError as err:
        raise CliError(
            f"cannot reach the API at {client.base_url} ({type(err).__name__})"
        ) from None


def _api_error(response: httpx.Response, lines: Sequence[int] = ()) -> CliError:
    """The API's error envelope as text; field errors about nodes[i] name the CSV line."""
    try:
        error = response.json()["error"]
        code, message = error["code"], error["message"]
        details = error.get("details") or {}
    except (ValueError, KeyError, TypeError):
        return CliError(f"the API answered {response.status_code}")
    out = [f"refused: {response.status_code} {code}: {message}"]
    for item in details.get("errors") or []:
        key = str(item.get("key", ""))
        where = key
        if key.startswith("nodes[") and "]" in key:
            index = key[len("nodes[") : key.index("]")]
            if index.isdigit() and int(index) < len(lines):
                where = f"line {lines[int(index)]} ({key})"
        out.append(f"  {where}: {item.get('message', item.get('code', ''))}")
    for item in details.get("conflicts") or []:
        ref = item.get("onboarding_id") or item.get("node_id") or ""
        out.append(f"  {item.get('hostname')}: {item.get('code')} {ref}".rstrip())
    if response.status_code == 503:
        out.append("  nothing was submitted; retry shortly")
    return CliError("\n".join(out))


def submit(
    client: httpx.Client,
    nodes: Sequence[CsvNode],
    *,
    site: uuid.UUID,
    profile: uuid.UUID,
    sku: str,
    idempotency_key: str | None,
) -> dict[str, Any]:
    body = {
        "site_id": str(site),
        "profile_id": str(profile),
        "sku_id": sku,
        "nodes": [{"hostname": n.hostname, "ipmi_ip": n.ipmi_ip} for n in nodes],
    }
    headers = {"X-Idempotency-Key": idempotency_key} if idempotency_key else {}
    response = _call(client, "POST", "/api/v1/admin/onboardings/batch", json=body, headers=headers)
    if response.status_code != 201:
        raise _api_error(response, [n.line for n in nodes])
    answer: dict[str, Any] = response.json()
    return answer


def batch_rows(client: httpx.Client, batch_id: str) -> list[dict[str, Any]]:
    """Every onboarding of the batch (all pages), by hostname."""
    items: list[dict[str, Any]] = []
    cursor: str | None = None
    while True:
        params: dict[str, Any] = {"batch_id": batch_id, "limit": PAGE}
        if cursor:
            params["cursor"] = cursor
        response = _call(client, "GET", "/api/v1/admin/onboardings", params=params)
        if response.status_code != 200:
            raise _api_error(response)
        page = response.json()
        items += page["items"]
        cursor = page.get("next_cursor")
        if not cursor:
            return sorted(items, key=lambda i: str(i["hostname"]))


# --- output ----------------------------------------------------------------------------------

_STYLE = {
    "completed": "green",
    "reconciled": "green",
    "running": "cyan",
    "pending": "dim",
    "compensating": "yellow",
    "cancelled": "yellow",
    "failed_retryable": "red",
    "failed_manual_intervention": "bold red",
}


def table(items: Sequence[dict[str, Any]], title: str) -> Table:
    out = Table(title=title, title_justify="left")
    for column in ("hostname", "stage", "status", "failure class", "recommended action"):
        out.add_column(column, overflow="fold")  # never cut a value short
    for item in items:
        status = str(item["status"])
        out.add_row(
            str(item["hostname"]),
            str(item["current_stage"]),
            f"[{_STYLE.get(status, '')}]{status}[/]" if status in _STYLE else status,
            str(item.get("failure_class") or ""),
            str(item.get("recommended_action") or ""),
        )
    return out


def summary_line(items: Sequence[dict[str, Any]]) -> str:
    counts: dict[str, int] = {}
    for item in items:
        counts[item["status"]] = counts.get(item["status"], 0) + 1
    return ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))


def settled(items: Sequence[dict[str, Any]]) -> bool:
    return bool(items) and all(i["status"] in SETTLED for i in items)


def watch(
    client: httpx.Client, console: Console, batch_id: str, *, interval: float
) -> list[dict[str, Any]]:
    """Poll until every node has settled: a live table on a terminal, one line per change
    otherwise (logs stay readable)."""
    title = f"batch {batch_id}"
    items = batch_rows(client, batch_id)
    if console.is_terminal:
        with Live(table(items, title), console=console, refresh_per_second=4) as live:
            while not settled(items):
                time.sleep(interval)
                items = batch_rows(client, batch_id)
                live.update(table(items, f"{title}: {summary_line(items)}"))
        return items
    last: dict[str, tuple[str, str]] = {}
    while True:
        for item in items:
            state = (str(item["status"]), str(item["current_stage"]))
            if last.get(item["hostname"]) != state:
                last[item["hostname"]] = state
                extra = f" ({item['failure_class']})" if item.get("failure_class") else ""
                console.print(f"{item['hostname']}: {state[0]} at {state[1]}{extra}")
        if settled(items):
            return items
        time.sleep(interval)
        items = batch_rows(client, batch_id)


def report(console: Console, batch_id: str, items: Sequence[dict[str, Any]]) -> int:
    console.print(table(items, f"batch {batch_id}"))
    console.print(f"{len(items)} node(s): {summary_line(items)}")
    failed = [i for i in items if i["status"] not in SUCCEEDED]
    for item in failed:
        action = item.get("recommended_action") or "inspect"
        console.print(
            f"  {item['hostname']} ({item['onboarding_id']}): {item['status']} at "
            f"{item['current_stage']}; recommended: {action}"
        )
    if failed:
        console.print(
            "Act on one with POST /api/v1/admin/onboardings/{id}/{retry|resume|rerun|cancel|...}"
        )
    return EXIT_OK if not failed else EXIT_FAILED


# --- commands --------------------------------------------------------------------------------


def run_import(args: argparse.Namespace, console: Console) -> int:
    nodes = read_csv(args.file)
    with _client(args) as client:
        answer = submit(
            client,
            nodes,
            site=args.site,
            profile=args.profile,
            sku=args.sku,
            idempotency_key=args.idempotency_key,
        )
        batch_id = str(answer["batch_id"])
        console.print(f"submitted batch {batch_id}: {len(answer['onboardings'])} node(s)")
        if args.no_wait:
            for item in answer["onboardings"]:
                console.print(f"  {item['hostname']}  onboarding {item['onboarding_id']}")
            console.print(f"watch it: gpucloud-onboard status {batch_id}")
            return EXIT_OK
        try:
            items = watch(client, console, batch_id, interval=args.poll_interval)
        except KeyboardInterrupt:
            console.print(
                f"stopped watching; the onboardings go on: gpucloud-onboard status {batch_id}"
            )
            return 130
        return report(console, batch_id, items)


def run_status(args: argparse.Namespace, console: Console) -> int:
    with _client(args) as client:
        items = batch_rows(client, str(args.batch_id))
    if not items:
        raise CliError(f"no onboardings in batch {args.batch_id}")
    console.print(table(items, f"batch {args.batch_id}: {summary_line(items)}"))
    return EXIT_OK


def _positive(value: str) -> float:
    number = float(value)
    if not 0 < number <= 3600:
        raise argparse.ArgumentTypeError("a number of seconds, more than 0 and at most 3600")
    return number


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpucloud-onboard",
        description="Onboard MAAS nodes from a CSV (hostname,ipmi_ip) and watch them.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    def connection(sub: argparse.ArgumentParser) -> None:
        sub.add_argument(
            "--api-url", help=f"default: $GPUCLOUD_API_URL, $GPUCLOUD_API or {DEFAULT_API_URL}"
        )
        sub.add_argument("--token", help="admin token; default: $GPUCLOUD_API_TOKEN")

    imp = commands.add_parser("import", help="submit a CSV as one batch and watch it")
    imp.add_argument("file", type=Path, help="CSV with a header row: hostname,ipmi_ip")
    imp.add_argument("--site", required=True, type=uuid.UUID, help="MAAS site id")
    imp.add_argument("--profile", required=True, type=uuid.UUID, help="the site's profile id")
    imp.add_argument("--sku", required=True, help="SKU name in the site's region")
    imp.add_argument("--no-wait", action="store_true", help="submit and exit")
    imp.add_argument(
        "--poll-interval", type=_positive, default=2.0, help="seconds between polls (2)"
    )
    imp.add_argument(
        "--idempotency-key",
        help="X-Idempotency-Key: resubmitting with the same key answers the same batch",
    )
    connection(imp)
    status = commands.add_parser("status", help="show a batch's nodes once")
    status.add_argument("batch_id", type=uuid.UUID)
    connection(status)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # Lines are never wrapped (logs and pipes keep one line per event); tables fit the width,
    # which for a pipe or a log is wide enough for a stage name per cell.
    console = Console(soft_wrap=True, highlight=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(soft_wrap=True, highlight=False, width=NON_TTY_WIDTH)
    try:
        if args.command == "import":
            return run_import(args, console)
        return run_status(args, console)
    except CliError as err:
        # One line per problem, never wrapped at the terminal's width: an operator greps and
        # copies "path:line: why" (a long path used to split mid-name).
        Console(stderr=True).print(str(err), markup=False, highlight=False, soft_wrap=True)
        return err.status


if __name__ == "__main__":
    sys.exit(main())
