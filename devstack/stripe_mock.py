"""Find (or build once) `stripe-mock`, Stripe's API mock, and start it on loopback ports."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from devstack.go_tools import go_tool_path

STRIPE_MOCK_MODULE = "github.com/stripe/stripe-mock@latest"


def stripe_mock_path(*, build: bool = True) -> Path:
    """`stripe-mock` from PATH, else the cached build, else build it with Go (once)."""
    return go_tool_path("stripe-mock", STRIPE_MOCK_MODULE, build=build)


def stripe_mock_argv(http_port: int, https_port: int, fixtures: Path | None = None) -> list[str]:
    """Both listeners on loopback (stripe-mock opens HTTPS on :12112 unless told otherwise)."""
    argv = [
        str(stripe_mock_path()),
        "-http-addr",
        f"127.0.0.1:{http_port}",
        "-https-addr",
        f"127.0.0.1:{https_port}",
    ]
    if fixtures is not None:
        argv += ["-fixtures", str(fixtures)]
    return argv


def write_fixtures(path: Path, **checkout_session: object) -> Path:
    """stripe-mock answers from fixed fixtures; this writes a copy of its bundled ones with the
    Checkout Session fixture changed (e.g. payment_status="paid", amount_total=5000), which is
    how a test makes Stripe report a session as paid. Needs the module source in Go's cache,
    which `go install` leaves there."""
    fixtures = json.loads(_bundled_fixtures().read_text())
    fixtures["resources"]["checkout.session"].update(checkout_session)
    path.write_text(json.dumps(fixtures))
    return path


def _bundled_fixtures() -> Path:
    modcache = subprocess.run(
        ["go", "env", "GOMODCACHE"], check=True, capture_output=True, text=True
    ).stdout.strip()
    found = sorted(Path(modcache, "github.com/stripe").glob("stripe-mock@*/embedded/openapi"))
    if not found:
        raise RuntimeError("stripe-mock sources are not in Go's module cache; run bin/bootstrap")
    return found[-1] / "fixtures3.json"
