"""`gpucloud-sim-ipmitool`: the `ipmitool` of a site whose BMCs are the MAAS simulator's.

The worker's real BMC path (activities/onboarding/ipmi.IpmitoolBmc) runs it exactly as it runs
ipmitool: `-I lanplus -H ADDRESS -U USER -E chassis power status|on|cycle`, the password in
IPMI_PASSWORD. It answers as ipmitool does (stdout, exit status, stderr on failure) by calling
the simulator's BMC control API at GPUCLOUD_SIM_MAAS_URL with GPUCLOUD_SIM_MAAS_CONTROL_TOKEN:
`status` is GET /_sim/bmc/{address} (the chassis's real power, as a BMC reports it), `on` and
`cycle` are POST /_sim/bmc/{address}/power-cycle. The simulator's BMCs accept any login; an
unknown address fails the way an unreachable BMC does.
"""

from __future__ import annotations

import argparse
import os
import sys
from urllib.parse import quote

import httpx

NO_SESSION = "Error: Unable to establish IPMI v2 / RMCP+ session"


def _base_url() -> str:
    url = os.environ.get("GPUCLOUD_SIM_MAAS_URL", "").rstrip("/")
    return url.removesuffix("/MAAS")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ipmitool", add_help=False)
    parser.add_argument("-I", dest="interface", default="lanplus")
    parser.add_argument("-H", dest="host", required=True)
    parser.add_argument("-U", dest="user", default="")
    parser.add_argument("-E", dest="env_password", action="store_true")
    parser.add_argument("command", nargs="+")
    args = parser.parse_args(argv)
    if args.command[:2] != ["chassis", "power"] or len(args.command) != 3:
        print(f"Invalid command: {' '.join(args.command)}", file=sys.stderr)
        return 1
    action = args.command[2]
    if action not in ("status", "on", "cycle"):
        print(f"Invalid chassis power command: {action}", file=sys.stderr)
        return 1
    token = os.environ.get("GPUCLOUD_SIM_MAAS_CONTROL_TOKEN", "")
    url = f"{_base_url()}/_sim/bmc/{quote(args.host, safe='')}"
    headers = {"Authorization": f"Bearer {token}"}
    try:
        if action == "status":
            response = httpx.get(url, headers=headers, timeout=10.0)
        else:
            response = httpx.post(
                f"{url}/power-cycle", json={"action": action}, headers=headers, timeout=10.0
            )
    except httpx.HTTPError:
        print(NO_SESSION, file=sys.stderr)
        return 1
    if response.status_code != 200:
        print(NO_SESSION, file=sys.stderr)
        return 1
    if action == "status":
        print(f"Chassis Power is {response.json().get('power', 'unknown')}")
        return 0
    print(f"Chassis Power Control: {'Up/On' if action == 'on' else 'Cycle'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
