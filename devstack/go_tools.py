"""Tools the stack builds once from Go modules (the temporal CLI, stripe-mock, the Temporal
server and its SQL tool): found on PATH, or in the cached tools folder, or built there with
`go install`."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

TOOLS_DIR = Path(
    os.environ.get("GPUCLOUD_TOOLS_DIR", Path.home() / ".cache" / "gpucloud" / "tools")
)


def _built_once(name: str, build: bool, build_into: Callable[[Path], Path]) -> Path:
    """The cached `name`, else what `build_into(a fresh work folder)` builds, moved into the
    cache under that name."""
    cached = TOOLS_DIR / name
    if cached.exists():
        return cached
    if not build:
        raise RuntimeError(f"{name} not found; run bin/bootstrap")
    TOOLS_DIR.mkdir(parents=True, exist_ok=True)
    # One build per tool at a time on this machine: bin/bootstrap, a test session and a stack
    # started together each find the tool missing, and parallel Go builds of the same module
    # on two cores take several times as long as one. The others wait and take its result.
    with (TOOLS_DIR / f".{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if cached.exists():
            return cached
        with tempfile.TemporaryDirectory(dir=TOOLS_DIR, prefix=f".build-{name}-") as work:
            build_into(Path(work)).replace(cached)
    return cached


def go_tool_path(name: str, module: str, *, build: bool = True, on_path: bool = True) -> Path:
    """`name` from PATH (unless `on_path` is false: a generic or versioned name), else the cached
    build, else `go install module` into the cache under that name (whatever the module's own
    binary is called: the Temporal server's is `server`)."""
    found = shutil.which(name) if on_path else None
    if found:
        return Path(found)

    def install(gobin: Path) -> Path:
        subprocess.run(
            ["go", "install", module], check=True, env={**os.environ, "GOBIN": str(gobin)}
        )
        (built,) = gobin.iterdir()
        return built

    return _built_once(name, build, install)


def go_wrapper_build(
    name: str, module: str, version: str, package: str | None = None, *, build: bool = True
) -> Path:
    """`package` (default: the module's main package) of `module@version` built into the cache
    as `name`, through a throwaway module that requires it: `go install module@version` refuses a
    module whose go.mod has replace directives, which a wrapper module simply does not apply."""

    def build_in_wrapper(work: Path) -> Path:
        (work / "go.mod").write_text(
            f"module gpucloud.build/{name}\n\ngo 1.19\n\nrequire {module} {version}\n"
        )
        output = work / name
        subprocess.run(
            ["go", "build", "-mod=mod", "-o", str(output), package or module], check=True, cwd=work
        )
        return output

    return _built_once(name, build, build_in_wrapper)


def go_module_dir(module_at_version: str) -> Path:
    """Where a module's source lies in Go's module cache (downloaded if it is not there): the
    Temporal server's SQL schemas and sample configurations ship in its module."""
    result = subprocess.run(
        ["go", "mod", "download", "-json", module_at_version],
        check=True,
        capture_output=True,
        text=True,
        cwd=tempfile.gettempdir(),  # outside any go.mod: the module is named with its version
    )
    return Path(json.loads(result.stdout)["Dir"])
