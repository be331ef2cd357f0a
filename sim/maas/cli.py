"""`python -m sim.maas`: the MAAS simulator as its own process.

    python -m sim.maas --host 127.0.0.1 --port 5240 --scenario sim/maas/scenarios/demo.toml \\
        --api-key-file maas.key [--control-token-file control.token] [--time-scale 0.02]

The MAAS URL is then http://HOST:PORT/MAAS (API under /MAAS/api/2.0/). The API key file holds
one `consumer_key:token_key:token_secret` per line (# comments allowed); without one a key is
generated and printed. The control API (/_sim/) takes `Authorization: Bearer <token>`, the token
from --control-token-file, else the first API key as a whole. --time-scale (real seconds per
simulated second) overrides the scenario's at start-up, and applies after a reset whose scenario
sets none.
"""

from __future__ import annotations

import argparse
import logging
import secrets
import sys
from pathlib import Path

import uvicorn

from core.crash_traces import enable_crash_traces
from sim.maas.auth import ApiKey, Authenticator
from sim.maas.build import build_region
from sim.maas.scenario import Scenario, ScenarioError
from sim.maas.server import MaasApp, Simulator

DEMO_SCENARIO = Path(__file__).parent / "scenarios" / "demo.toml"


def read_keys(path: Path) -> list[ApiKey]:
    lines = [line.strip() for line in path.read_text().splitlines()]
    return [ApiKey.parse(line) for line in lines if line and not line.startswith("#")]


def generated_key() -> ApiKey:
    return ApiKey(secrets.token_urlsafe(14), secrets.token_urlsafe(14), secrets.token_urlsafe(24))


def build_app(
    scenario: Scenario,
    keys: list[ApiKey],
    control_token: str,
    time_scale: float | None = None,
) -> MaasApp:
    region = build_region(scenario, time_scale)
    auth = Authenticator(keys, scenario.site.admin_user)
    return MaasApp(Simulator(region, auth, control_token, default_time_scale=time_scale))


def main(argv: list[str] | None = None) -> int:
    enable_crash_traces()
    parser = argparse.ArgumentParser(prog="python -m sim.maas", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=5240)
    parser.add_argument(
        "--scenario",
        type=Path,
        default=DEMO_SCENARIO,
        help="TOML or JSON scenario (default: the demo site)",
    )
    parser.add_argument("--api-key-file", type=Path, help="consumer:token:secret per line")
    parser.add_argument(
        "--control-token-file",
        type=Path,
        help="bearer token for /_sim/ (default: the first API key)",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        help="real seconds per simulated second (overrides the scenario)",
    )
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")

    try:
        scenario = Scenario.load(args.scenario)
    except (OSError, ScenarioError) as exc:
        print(f"sim.maas: cannot load {args.scenario}: {exc}", file=sys.stderr)
        return 2
    if args.time_scale is not None and args.time_scale <= 0:
        parser.error("--time-scale must be positive")
    keys = read_keys(args.api_key_file) if args.api_key_file else [generated_key()]
    if not keys:
        parser.error(f"no API key in {args.api_key_file}")
    if not args.api_key_file:
        print(f"sim.maas: generated API key {keys[0]}", flush=True)
    token = args.control_token_file.read_text().strip() if args.control_token_file else str(keys[0])
    app = build_app(scenario, keys, token, args.time_scale)
    print(
        f"sim.maas: MAAS {scenario.site.maas_version} simulator at "
        f"http://{args.host}:{args.port}/MAAS ({len(scenario.machines)} machines, time scale "
        f"{app.sim.region.clock.time_scale})",
        flush=True,
    )
    # A real MAAS sits behind a web server that keeps idle connections far longer than uvicorn's
    # 5 s, which equals httpx's own keep-alive expiry: a client reusing a pooled connection at
    # the 5 s mark raced the server's close ("Server disconnected without sending a response").
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        timeout_keep_alive=75,
    )
    uvicorn.Server(config).run()
    return 0
