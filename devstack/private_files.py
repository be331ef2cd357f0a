"""Files only the stack's own user may read (tokens, passwords, AppRole ids, configurations that
hold a password), written whole: a reader sees the old content or the new, never a part."""

from __future__ import annotations

import os
from pathlib import Path


def write_private(path: Path, text: str) -> None:
    """`text` into `path`, mode 0600, through a temporary file renamed over it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o600)  # a leftover temporary file may have had looser bits
    tmp.replace(path)
