"""`python -m sim.vault`: serve the Vault simulator with uvicorn.

The root token comes from --root-token-file: read when the file exists, else generated once and
written there (mode 0600), so a restarted server keeps its token. With --data-file the secrets are
kept in that JSON file (mode 0600, rewritten atomically on each change) and survive restarts; it
is plaintext on disk, like Vault's own `-dev` mode: a development convenience only.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import string
from pathlib import Path

import uvicorn

from core.crash_traces import enable_crash_traces
from sim.vault.app import VaultApp
from sim.vault.kv import KVStore

log = logging.getLogger("sim.vault")

_TOKEN_ALPHABET = string.ascii_letters + string.digits


def new_root_token() -> str:
    """A token shaped like Vault's service tokens: `hvs.` and 24 base62 characters."""
    return "hvs." + "".join(secrets.choice(_TOKEN_ALPHABET) for _ in range(24))


def ensure_root_token(path: Path) -> str:
    """The token in `path`, or a new one written there (0600, atomically) when it is missing."""
    try:
        token = path.read_text().strip()
    except FileNotFoundError:
        token = ""
    if token:
        return token
    token = new_root_token()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.chmod(tmp, 0o600)
    tmp.replace(path)
    return token


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m sim.vault",
        description="A KV v2 Vault simulator answering hvac like HashiCorp Vault.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8200, help="port (default: %(default)s)")
    parser.add_argument(
        "--root-token-file",
        type=Path,
        required=True,
        help="the root token; generated (mode 0600) when the file is missing",
    )
    parser.add_argument(
        "--data-file",
        type=Path,
        default=None,
        help="keep secrets in this JSON file across restarts (default: memory)",
    )
    parser.add_argument(
        "--mount",
        action="append",
        dest="mounts",
        metavar="NAME",
        help="a KV v2 mount; repeat for more (default: kv)",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
    return parser.parse_args(argv)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    enable_crash_traces()
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    mounts = [m.strip("/") for m in (args.mounts or ["kv"])]
    if any(not m or m in ("sys", "auth") for m in mounts):
        raise SystemExit(f"invalid mount names: {mounts}")
    store = KVStore(mounts, data_file=args.data_file)
    app = VaultApp(store, ensure_root_token(args.root_token_file))
    where = args.data_file or "memory only"
    log.info("KV v2 mounts %s; data in %s; root token in %s", store.mounts, where,
             args.root_token_file)  # fmt: skip
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        http="h11",  # httptools refuses Vault's LIST method
        lifespan="on",
        access_log=True,  # method, path and status only: never bodies or headers
        server_header=False,
        log_config=None,
        timeout_graceful_shutdown=5,
    )
    return 0
