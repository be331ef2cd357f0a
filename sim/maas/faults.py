"""Faults the simulated MAAS can be told to have.

Machine faults belong to one physical machine (a scenario `[[machines]]` entry) and shape what
MAAS reports about it:

    boss_disk_missing       commissioning finds no BOSS disk (the M.2 boot module is absent)
    commissioning_fails     commissioning ends in "Failed commissioning"       (times, message)
    deploy_fails_datasource deployment fails the way a cloud-init datasource failure looks in the
                            MAAS event log; `times` defaults to 1, so a redeploy then succeeds
                            (variant "final": a 'cloudinit' installation failure event;
                             variant "timeout": the LP#1960944 log, a 30-minute timeout)
    deploy_fails            deployment fails with a curtin installation failure  (times, message)
    erase_fails             disk erasing ends in "Failed disk erasing"
    vanishes                the machine is deleted from MAAS `after` seconds after it enters the
                            status `when` (default "Deploying")
    hw_sync_never_healthy   the deployed OS never posts hardware sync: last_sync stays where
                            deployment left it and goes stale after 1.5 x sync_interval (a
                            restart of its timer, as a re-seed makes, posts nothing either)
    token_delayed           op=get_token answers null for `after` seconds after MAAS creates the
                            node key
    pxe_unlinked            after commissioning the PXE interface has no subnet link (link_up)
    power_stuck_on          the BMC accepts power-off but the machine stays on: a release ends
                            in "Releasing failed", power_off leaves it on (`times`: how many
                            power-offs fail; default every one)

Request faults shape HTTP answers. In a machine's list they apply to requests about that machine
(its URL carries the system_id); in the scenario's top-level `[[faults]]` list, to any request
(or to `machine`, a system_id or hostname):

    http_error   answer `status` (default 503) instead, for a fraction `rate` of matching requests
                 (default 1.0), at most `times` times; with `applied = true` the request takes
                 effect first and only its answer is lost
    slow         wait `delay` real seconds before answering (rate/times as above)
    truncate_list  a list answer (e.g. `GET machines/`, op "machines.read") keeps only its first
                 `keep` items (default 0: an empty list), as a region that lost part of its
                 database, or a proxy that cut the body, would answer (rate/times as above; a
                 request whose answer is no list is left alone and does not use up a strike)

`op` limits a request fault to operations named as the counters name them (e.g.
"machine.deploy", "machines.read"); empty means every MAAS API operation.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

BOSS_DISK_MISSING = "boss_disk_missing"
COMMISSIONING_FAILS = "commissioning_fails"
DEPLOY_FAILS_DATASOURCE = "deploy_fails_datasource"
DEPLOY_FAILS = "deploy_fails"
ERASE_FAILS = "erase_fails"
VANISHES = "vanishes"
HW_SYNC_NEVER_HEALTHY = "hw_sync_never_healthy"
TOKEN_DELAYED = "token_delayed"  # noqa: S105 - a fault kind, not a secret
PXE_UNLINKED = "pxe_unlinked"
POWER_STUCK_ON = "power_stuck_on"
HTTP_ERROR = "http_error"
SLOW = "slow"
TRUNCATE_LIST = "truncate_list"

MACHINE_KINDS = frozenset(
    {
        BOSS_DISK_MISSING,
        COMMISSIONING_FAILS,
        DEPLOY_FAILS_DATASOURCE,
        DEPLOY_FAILS,
        ERASE_FAILS,
        VANISHES,
        HW_SYNC_NEVER_HEALTHY,
        TOKEN_DELAYED,
        PXE_UNLINKED,
        POWER_STUCK_ON,
    }
)
REQUEST_KINDS = frozenset({HTTP_ERROR, SLOW, TRUNCATE_LIST})
DATASOURCE_VARIANTS = ("final", "timeout")

# Fields each kind may set, besides `kind` and `times`.
_FIELDS_BY_KIND: dict[str, frozenset[str]] = {
    BOSS_DISK_MISSING: frozenset(),
    COMMISSIONING_FAILS: frozenset({"message"}),
    DEPLOY_FAILS_DATASOURCE: frozenset({"message", "variant"}),
    DEPLOY_FAILS: frozenset({"message"}),
    ERASE_FAILS: frozenset({"message"}),
    VANISHES: frozenset({"when", "after"}),
    HW_SYNC_NEVER_HEALTHY: frozenset(),
    TOKEN_DELAYED: frozenset({"after"}),
    PXE_UNLINKED: frozenset(),
    POWER_STUCK_ON: frozenset(),
    HTTP_ERROR: frozenset({"op", "rate", "status", "applied", "machine", "message"}),
    SLOW: frozenset({"op", "rate", "delay", "machine"}),
    TRUNCATE_LIST: frozenset({"op", "rate", "keep"}),
}


class FaultError(ValueError):
    pass


@dataclass(frozen=True)
class FaultSpec:
    kind: str
    times: int | None = None  # None: every time (deploy_fails_datasource defaults to 1)
    message: str | None = None
    variant: str = "final"
    when: str = "Deploying"
    after: float = 0.0  # simulated seconds (scaled by the time scale)
    op: tuple[str, ...] = ()
    rate: float = 1.0
    status: int = 503
    delay: float = 0.0  # real seconds: it is about the client's HTTP timeouts
    applied: bool = False
    machine: str | None = None
    keep: int = 0  # truncate_list: how many items of the list answer remain

    def __post_init__(self) -> None:
        if self.kind not in _FIELDS_BY_KIND:
            known = ", ".join(sorted(_FIELDS_BY_KIND))
            raise FaultError(f"unknown fault kind {self.kind!r} (known: {known})")
        if self.times is not None and self.times < 1:
            raise FaultError("times must be at least 1 (or absent for always)")
        if not 0.0 <= self.rate <= 1.0:
            raise FaultError("rate is a fraction between 0 and 1")
        if self.after < 0 or self.delay < 0 or self.keep < 0:
            raise FaultError("after, delay and keep must not be negative")
        if self.kind == HTTP_ERROR and not 500 <= self.status <= 599:
            raise FaultError("http_error status must be a 5xx code")
        if self.kind == DEPLOY_FAILS_DATASOURCE and self.variant not in DATASOURCE_VARIANTS:
            raise FaultError(f"variant must be one of {', '.join(DATASOURCE_VARIANTS)}")

    @property
    def is_request_fault(self) -> bool:
        return self.kind in REQUEST_KINDS

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FaultSpec:
        if "kind" not in data:
            raise FaultError("a fault needs a kind")
        kind = str(data["kind"])
        allowed = _FIELDS_BY_KIND.get(kind)
        if allowed is None:
            return cls(kind)  # raises the unknown-kind error
        unknown = set(data) - allowed - {"kind", "times"}
        if unknown:
            raise FaultError(f"fault {kind} does not take: {', '.join(sorted(unknown))}")
        values = dict(data)
        if kind == DEPLOY_FAILS_DATASOURCE and "times" not in values:
            values["times"] = 1
        if isinstance(values.get("op"), str):
            values["op"] = (values["op"],)
        if "op" in values:
            values["op"] = tuple(str(o) for o in values["op"])
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["op"] = list(self.op)
        return data


@dataclass
class Fault:
    """An armed fault; `fired` counts how often it has struck."""

    spec: FaultSpec
    fired: int = 0

    @property
    def spent(self) -> bool:
        return self.spec.times is not None and self.fired >= self.spec.times

    def to_dict(self) -> dict[str, Any]:
        return {**self.spec.to_dict(), "fired": self.fired}


@dataclass
class FaultSet:
    """The faults armed on one machine (or on the whole site, for request faults)."""

    faults: list[Fault] = field(default_factory=list)

    @classmethod
    def of(cls, specs: Iterable[FaultSpec]) -> FaultSet:
        return cls([Fault(spec) for spec in specs])

    def add(self, spec: FaultSpec) -> None:
        self.faults.append(Fault(spec))

    def clear(self) -> None:
        self.faults.clear()

    def has(self, kind: str) -> bool:
        """A standing condition (e.g. boss_disk_missing): armed and not used up."""
        return any(f.spec.kind == kind and not f.spent for f in self.faults)

    def get(self, kind: str) -> FaultSpec | None:
        for fault in self.faults:
            if fault.spec.kind == kind and not fault.spent:
                return fault.spec
        return None

    def take(self, kind: str) -> FaultSpec | None:
        """Consume one strike of the first armed fault of this kind."""
        for fault in self.faults:
            if fault.spec.kind == kind and not fault.spent:
                fault.fired += 1
                return fault.spec
        return None

    def take_request(
        self, kind: str, op: str, rng: random.Random, machine_refs: Iterable[str] = ()
    ) -> FaultSpec | None:
        """The request fault of this kind that strikes this request, if any."""
        refs = set(machine_refs)
        for fault in self.faults:
            spec = fault.spec
            if spec.kind != kind or fault.spent:
                continue
            if spec.op and op not in spec.op:
                continue
            if spec.machine is not None and spec.machine not in refs:
                continue
            if spec.rate < 1.0 and rng.random() >= spec.rate:
                continue
            fault.fired += 1
            return spec
        return None

    def to_list(self) -> list[dict[str, Any]]:
        return [f.to_dict() for f in self.faults]
