"""What a handler gets: the region, the parsed request, the authenticated user and the op."""

from __future__ import annotations

from dataclasses import dataclass

from sim.maas.http import Params, Request
from sim.maas.region import Region


@dataclass
class Ctx:
    region: Region
    request: Request
    user: str | None  # None: anonymous
    op: str | None
    is_superuser: bool = True  # of `user`; the site's admin unless the control API added others

    @property
    def params(self) -> Params:
        return self.request.params

    @property
    def username(self) -> str:
        return self.user or "unknown"
