"""The MAAS-side onboarding stages (docs/lifecycles/onboarding.md#stages), each status-aware so that
re-entry from the top converges instead of duplicating work (§4.10): a machine is looked up before
it is created, commissioning and deploy are never re-issued on a machine that is already past them,
and every destructive step reads the machine's current state first (§4.13).

Discovery (§4.16) in `create_or_find_in_maas`: hostname, then IPMI power address, then PXE MAC;
else the machine is created from its BMC alone (an IPMI-only record MAAS cannot commission until
the machine PXE-boots into it), the BMC is power-cycled, and the poll claims the record that
becomes usable, or exactly one machine that appeared at that BMC or anywhere during this run;
several candidates fail closed with state_ambiguity. A sole pre-existing New machine is claimed
only when the site opts in (auto_claim_single_new_machine).

No BMC is power-cycled on an address alone (`_check_bmc`, issue 35): first the evidence is
obtained in the same run and recorded (an event before the cycle, the stage's details after):
what MAAS has at that address (each machine's status, owner, binding to a node, holder job), the
power address of the record found for this hostname, and the chassis power the BMC reports. The
cycle is refused with state_ambiguity when the address is another machine's (`bmc_in_use`: one
MAAS has at the address besides this job's own IPMI-only record, or that record is past New,
owned, bound to another live node or held by another live job), when the record found for this
hostname names another BMC than the operator declared (`bmc_address_mismatch`), or when the
chassis is not off (`bmc_chassis_on`: a running host that MAAS does not know at this address;
powering it off is the operator's call) unless this job itself power-cycled that BMC in an
earlier attempt. A BMC that cannot be asked is bmc_power_failure.

Whatever is found or discovered is claimed before anything touches it (`claim_machine`, issue
35): a machine bound to another live node or held by another live onboarding job fails the
stage with state_ambiguity naming both, and the job row's maas_system_id, unique among live jobs
of a site, is the claim two concurrent discoveries race for.
"""

from __future__ import annotations

import ipaddress
import re
import uuid
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.maas.client import MaasClient
from activities.maas.errors import MaasNotFound
from activities.maas.types import (
    EraseMode,
    Interface,
    IpmiPowerParameters,
    LinkMode,
    Machine,
    MachineStatus,
    PowerState,
)
from activities.onboarding import read_model
from activities.onboarding.host_access import BmcLogin
from activities.onboarding.stage_errors import StageError
from activities.onboarding.stage_runtime import (
    StageActivitiesBase,
    StageRun,
    observe,
    poll_until,
    timeout_error,
)
from activities.power_credentials import (
    OVERRIDE_SOURCE_PREFIX,
    PowerCredentialsMissing,
    resolve_power_credentials,
)
from contracts.onboarding import (
    OnboardState,
    SiteConfig,
    Stage,
    StageInput,
    StageResult,
)
from contracts.states import NodeStatus
from core.failures import ClassifiedError, FailureClass
from schema.models import (
    MaasRoceAssignment,
    Node,
    NodeMaasState,
    NodeOnboarding,
    NodeOnboardingEvent,
)

S = MachineStatus
BOSS_PATTERN = re.compile(r"boss|boot optimi[sz]ed|m\.2", re.IGNORECASE)
# Past these, the machine's storage and interfaces can no longer be edited (deploy has begun).
DEPLOY_BOUND = frozenset({S.ALLOCATED, S.DEPLOYING, S.DEPLOYED, S.FAILED_DEPLOYMENT})
COMMISSION_ACTIVE = frozenset({S.COMMISSIONING, S.TESTING})
COMMISSION_FAILED = frozenset({S.FAILED_COMMISSIONING, S.FAILED_TESTING, S.BROKEN})
DATASOURCE_PATTERN = re.compile(r"no datasource|datasource|cloud-?init", re.IGNORECASE)
RELEASABLE = frozenset({S.ALLOCATED, S.DEPLOYED, S.FAILED_DEPLOYMENT, S.BROKEN})
# schema.models.ONBOARDING_LIVE: the job statuses that hold a machine.
ONBOARDING_LIVE_STATUSES = (
    "pending",
    "running",
    "compensating",
    "failed_retryable",
    "failed_manual_intervention",
)


def _ambiguity(code: str, message: str, **details: Any) -> StageError:
    return StageError(
        FailureClass.STATE_AMBIGUITY, code, message, details=details, non_retryable=True
    )


async def claim_machine(
    sessions: async_sessionmaker[AsyncSession], run: StageRun, machine: Machine
) -> None:
    """Bind `machine` to this job (issue 35): refused with state_ambiguity, naming both, when
    another live node (not deleted) is bound to it or another live onboarding job holds it.
    The job row's maas_system_id is the claim; the partial unique index
    node_onboardings_live_machine settles two discoveries racing for one machine."""
    site_id = uuid.UUID(run.site.site_id)
    node_id = uuid.UUID(run.input.onboarding.node_id)
    system_id = machine.system_id
    async with sessions() as session, session.begin():
        bound = (
            await session.execute(
                select(Node.id, Node.hostname, Node.status)
                .join(NodeMaasState, NodeMaasState.node_id == Node.id)
                .where(
                    NodeMaasState.site_id == site_id,
                    NodeMaasState.maas_system_id == system_id,
                    Node.status != NodeStatus.DELETED,
                    Node.id != node_id,
                )
            )
        ).first()
        if bound is not None:
            raise _ambiguity(
                "machine_bound_to_node",
                f"MAAS machine {system_id} ({machine.hostname}, {machine.status.label}) is bound "
                f"to node {bound.id} ({bound.hostname}, {bound.status}); nothing was done to it",
                system_id=system_id,
                maas_hostname=machine.hostname,
                maas_status=machine.status.label,
                bound_node_id=str(bound.id),
                bound_hostname=bound.hostname,
                bound_node_status=str(bound.status),
            )
        holder = await _live_holder(session, site_id, system_id, run.onboarding_id)
        if holder is None:
            try:
                async with session.begin_nested():
                    await session.execute(
                        update(NodeOnboarding)
                        .where(NodeOnboarding.onboarding_id == run.onboarding_id)
                        .values(maas_system_id=system_id, updated_at=func.now())
                    )
                return
            except IntegrityError:
                # Another discovery claimed it between the look and the write.
                holder = await _live_holder(session, site_id, system_id, run.onboarding_id)
        raise _ambiguity(
            "machine_held_by_job",
            f"MAAS machine {system_id} ({machine.hostname}, {machine.status.label}) is held by "
            f"onboarding {holder.onboarding_id if holder else '(another live job)'}"
            f"{f' ({holder.hostname}, {holder.status})' if holder else ''}; "
            "nothing was done to it",
            system_id=system_id,
            maas_hostname=machine.hostname,
            maas_status=machine.status.label,
            holder_onboarding_id=str(holder.onboarding_id) if holder else None,
            holder_hostname=holder.hostname if holder else None,
            holder_status=holder.status if holder else None,
        )


async def _live_holder(
    session: AsyncSession, site_id: uuid.UUID, system_id: str, onboarding_id: uuid.UUID
) -> Any:
    return (
        await session.execute(
            select(NodeOnboarding.onboarding_id, NodeOnboarding.hostname, NodeOnboarding.status)
            .where(
                NodeOnboarding.site_id == site_id,
                NodeOnboarding.maas_system_id == system_id,
                NodeOnboarding.status.in_(ONBOARDING_LIVE_STATUSES),
                NodeOnboarding.onboarding_id != onboarding_id,
            )
            .limit(1)
        )
    ).first()


async def get_machine_or_ambiguity(maas: MaasClient, system_id: str) -> Machine:
    try:
        return await maas.get_machine(system_id)
    except MaasNotFound as err:
        raise _ambiguity(
            "machine_deleted",
            f"machine {system_id} is no longer in MAAS (deleted out of band?)",
            system_id=system_id,
        ) from err


class MaasStageActivities(StageActivitiesBase):
    # ------------------------------------------------------------------ power credentials

    @activity.defn(name="onboarding.resolve_power_credentials")
    async def resolve_power_credentials(self, input: StageInput) -> StageResult:
        """Which credentials apply; the secret itself is read again by the stages that use it,
        so it never enters workflow history."""
        async with self.stage(input, Stage.RESOLVE_POWER_CREDENTIALS) as run:
            login, source = await self._bmc_login(run)
            state = input.state
            state.power_source = source
            run.done(state, f"power credentials from {source}", user=login.user)
        assert run.result is not None
        return run.result

    async def _bmc_login(self, run: StageRun) -> tuple[BmcLogin, str]:
        ob = run.input.onboarding
        try:
            async with self.deps.sessions() as session:
                creds = await resolve_power_credentials(
                    session,
                    self.deps.secrets,
                    uuid.UUID(ob.site_id),
                    pxe_macs=[ob.pxe_mac] if ob.pxe_mac else [],
                    ipmi_ip=ob.ipmi_ip,
                    hostname=ob.hostname,
                )
        except PowerCredentialsMissing as err:
            raise StageError(
                FailureClass.SITE_CAPABILITY_MISSING,
                "power_credentials_missing",
                str(err),
                non_retryable=True,
            ) from err
        return BmcLogin(address=ob.ipmi_ip, user=creds.user, password=creds.password), creds.source

    # ------------------------------------------------------------------ create or find

    @activity.defn(name="onboarding.create_or_find_in_maas")
    async def create_or_find_in_maas(self, input: StageInput) -> StageResult:
        async with self.stage(input, Stage.CREATE_OR_FIND_IN_MAAS) as run:
            site, ob = run.site, input.onboarding
            async with self.maas(site) as maas:
                found, how = await self._lookup(maas, ob.hostname, ob.ipmi_ip, ob.pxe_mac)
                if found is not None and _usable(found):
                    # Bound to another node or held by another job: refuse before anything
                    # touches the machine (a mistyped BMC address must not adopt a live node).
                    await claim_machine(self.deps.sessions, run, found)
                    run.done(
                        observe(_with_system(input, found), found),
                        f"found by {how}",
                        how=how,
                        found_status=found.status.label,
                        claimed=found.system_id,
                    )
                else:
                    machine, how, details = await self._discover(run, maas, found)
                    await claim_machine(self.deps.sessions, run, machine)
                    placeholder = details.pop("placeholder", None)
                    if placeholder is not None and await _delete_placeholder(maas, placeholder):
                        details["placeholder_deleted"] = placeholder
                    run.done(
                        observe(_with_system(input, machine), machine),
                        f"claimed by {how}",
                        how=how,
                        found_status=machine.status.label,
                        claimed=machine.system_id,
                        **details,
                    )
        assert run.result is not None
        return run.result

    async def _lookup(
        self, maas: MaasClient, hostname: str, ipmi_ip: str, pxe_mac: str | None
    ) -> tuple[Machine | None, str]:
        by_name = await maas.list_machines(hostnames=[hostname])
        if len(by_name) == 1:
            return by_name[0], "hostname"
        at_bmc = await self._at_bmc(maas, ipmi_ip)
        if at_bmc is not None:
            return at_bmc, "ipmi_power_address"
        if pxe_mac:
            by_mac = await maas.list_machines(mac_addresses=[pxe_mac])
            if len(by_mac) == 1:
                return by_mac[0], "pxe_mac"
        return None, "none"

    @staticmethod
    async def _at_bmc(maas: MaasClient, ipmi_ip: str) -> Machine | None:
        addresses = await maas.power_addresses()
        at_bmc = sorted(s for s, addr in addresses.items() if addr == ipmi_ip)
        if len(at_bmc) > 1:
            # Two records claim one BMC: which one is this machine is not ours to guess.
            raise _ambiguity(
                "bmc_address_ambiguous",
                f"{len(at_bmc)} MAAS machines use power address {ipmi_ip}",
                candidates=at_bmc,
            )
        return await maas.get_machine(at_bmc[0]) if at_bmc else None

    async def _discover(
        self, run: StageRun, maas: MaasClient, record: Machine | None
    ) -> tuple[Machine, str, dict[str, Any]]:
        """(machine, how it was claimed, details). Every poll asks MAAS for our own record and
        for New machines only (`status=new`, and `mac_address=` when the PXE MAC is known),
        never for the whole inventory."""
        site, ob = run.site, run.input.onboarding
        auto_claim = site.policy.auto_claim_single_new_machine
        new_before = await self._new_machines(maas, exclude=record)
        if record is None and auto_claim and len(new_before) == 1:
            # The site opted in and the sole New machine is already there: claim it now,
            # without an IPMI record of ours that it would then collide with on hostname.
            return new_before[0], "auto_claim", {}
        login, _ = await self._bmc_login(run)
        # The BMC is checked before a record is made for it, and MAAS again right before the
        # cycle (a machine may have appeared at the address meanwhile).
        evidence = await self._check_bmc(run, maas, record, login)
        if record is None:
            record = await maas.create_machine(
                hostname=ob.hostname,
                power=_ipmi_power(login),
            )
        if _usable(record):
            return record, "discovery", {"bmc_check": evidence}
        evidence = await self._check_bmc(run, maas, record, login)
        await self._record_bmc_check(run, evidence)
        await self.deps.host_access.bmc.power_cycle(login)
        try:
            machine, how, details = await self._poll_discovery(run, maas, record, new_before)
        except StageError as err:
            err.details.setdefault("bmc_check", evidence)
            raise
        return machine, how, {**details, "bmc_check": evidence}

    async def _poll_discovery(
        self, run: StageRun, maas: MaasClient, record: Machine, new_before: list[Machine]
    ) -> tuple[Machine, str, dict[str, Any]]:
        site, ob = run.site, run.input.onboarding
        auto_claim = site.policy.auto_claim_single_new_machine
        placeholder = record.system_id
        before = {m.system_id for m in new_before}
        seen_new: list[Machine] = []

        async def check() -> tuple[Machine, str] | None:
            try:
                ours = await maas.get_machine(placeholder)
            except MaasNotFound:
                # Another discovery at this BMC shared the record and deleted it once it
                # claimed the machine: whatever sits at the BMC now is the candidate (and the
                # claim then says whose it is).
                at_bmc = await self._at_bmc(maas, ob.ipmi_ip)
                if at_bmc is not None and _usable(at_bmc):
                    return at_bmc, "ipmi_power_address"
                raise _ambiguity(
                    "machine_deleted",
                    f"machine {placeholder} is no longer in MAAS (deleted out of band?)",
                    system_id=placeholder,
                ) from None
            if _usable(ours):
                return ours, "discovery"
            if ob.pxe_mac:
                by_mac = await maas.list_machines(mac_addresses=[ob.pxe_mac])
                if len(by_mac) == 1:
                    return by_mac[0], "pxe_mac"
            seen_new[:] = await self._new_machines(maas, exclude=ours)
            appeared = [m for m in seen_new if m.system_id not in before]
            if len(appeared) > 1:
                raise _ambiguity(
                    "discovery_ambiguous",
                    f"{len(appeared)} machines appeared during discovery",
                    candidates=sorted(m.system_id for m in appeared),
                )
            if appeared:
                return appeared[0], "discovery"
            if auto_claim and len(seen_new) == 1:
                return seen_new[0], "auto_claim"
            return None

        found = await poll_until(
            site,
            site.policy.discovery_timeout_seconds,
            check,
            progress=lambda: {"stage": "discovery", "system_id": placeholder},
        )
        if found is not None:
            machine, how = found
            if machine.system_id == placeholder:
                return machine, how, {}
            # Another record is the machine: ours, still IPMI-only, would keep the hostname
            # commission_node gives the claimed one (MAAS refuses a duplicate hostname) and
            # a second record at this BMC. It is deleted once the claim holds.
            return machine, how, {"placeholder": placeholder}
        if len(seen_new) > 1 and auto_claim:
            raise _ambiguity(
                "discovery_ambiguous",
                "several New machines and none matched this node",
                candidates=sorted(m.system_id for m in seen_new),
            )
        raise timeout_error(
            "discovery",
            f"no machine PXE-booted into MAAS from BMC {ob.ipmi_ip} in time",
            system_id=placeholder,
        )

    async def _check_bmc(
        self,
        run: StageRun,
        maas: MaasClient,
        record: Machine | None,
        login: BmcLogin,
        *,
        power: str | None = None,
    ) -> dict[str, Any]:
        """The evidence that the BMC at the declared address is the machine this job may
        power-cycle, obtained now; raises state_ambiguity (the evidence in its details) when it
        is not. `power`: the chassis state already read in this attempt (not asked twice)."""
        ob = run.input.onboarding
        address = ob.ipmi_ip
        addresses = await maas.power_addresses()
        # In MAAS's order (creation order): of two discoveries' records, the earlier wins.
        at_address = [s for s, a in addresses.items() if a == address]
        ours_at = (
            at_address.index(record.system_id)
            if record and record.system_id in at_address
            else None
        )
        evidence: dict[str, Any] = {
            "address": address,
            "record": record.system_id if record is not None else None,
            "record_power_address": addresses.get(record.system_id) if record else None,
            "maas_at_address": [],
        }
        others: list[dict[str, Any]] = []
        for position, system_id in enumerate(at_address):
            try:
                machine = await maas.get_machine(system_id)
            except MaasNotFound:
                continue  # deleted between the two reads: nothing at the address to cycle
            seen = await self._machine_holders(run, machine)
            evidence["maas_at_address"].append(seen)
            if record is not None and system_id == record.system_id:
                continue
            # A concurrent discovery's IPMI-only record for this BMC (New, no interfaces, owned,
            # bound and held by nobody) made after ours is not a machine MAAS knows there (that
            # discovery defers to this one); one made before ours is that discovery's: refused.
            later = ours_at is not None and position > ours_at
            if not (later and _placeholder(machine) and not _taken(seen)):
                others.append(seen)
        if record is not None:
            mine = next(
                (m for m in evidence["maas_at_address"] if m["system_id"] == record.system_id),
                None,
            ) or await self._machine_holders(run, record)
            # This job's own record may be cycled only while nobody has it: IPMI-only New,
            # no owner, bound to no other node, held by no other job.
            if mine["status"] != S.NEW.label or mine["owner"] or _taken(mine):
                others.append(mine)

        def refuse(code: str, message: str) -> StageError:
            evidence["verdict"] = f"refused: {code}"
            return _ambiguity(code, message, bmc_check=evidence)

        if others:
            first = others[0]
            named = (
                f"node {first['bound_node_id']} ({first['bound_hostname']})"
                if first.get("bound_node_id")
                else f"onboarding {first['holder_onboarding_id']}"
                if first.get("holder_onboarding_id")
                else f"owner {first['owner']}"
                if first["owner"]
                else "no node"
            )
            raise refuse(
                "bmc_in_use",
                f"BMC {address} is MAAS machine {first['system_id']}'s ({first['hostname']}, "
                f"{first['status']}, bound to {named}); it was not power-cycled",
            )
        record_address = evidence["record_power_address"]
        if record is not None and record_address and record_address != address:
            raise refuse(
                "bmc_address_mismatch",
                f"MAAS machine {record.system_id} ({record.hostname}) has BMC {record_address}, "
                f"the onboarding declares {address}; neither was power-cycled",
            )
        # MAAS has nothing else at the address: now the BMC itself is asked.
        if power is None:
            power = await self.deps.host_access.bmc.power_status(login)
        evidence["power"] = power
        evidence["cycled_before"] = await self._cycled_before(run, address)
        if power != PowerState.OFF and not evidence["cycled_before"]:
            raise refuse(
                "bmc_chassis_on",
                f"the chassis at BMC {address} is {power} and MAAS knows no machine there: a "
                "running host is not power-cycled on an address alone; if it is the machine "
                "to onboard, power it off at its BMC, then retry",
            )
        evidence["verdict"] = "ok"
        return evidence

    async def _machine_holders(self, run: StageRun, machine: Machine) -> dict[str, Any]:
        """What MAAS and this control plane say about `machine`: status, owner, the live node
        bound to it and the live onboarding (other than this one) holding it."""
        site_id = uuid.UUID(run.site.site_id)
        node_id = uuid.UUID(run.input.onboarding.node_id)
        seen: dict[str, Any] = {
            "system_id": machine.system_id,
            "hostname": machine.hostname,
            "status": machine.status.label,
            "owner": machine.owner,
            "power_state": str(machine.power_state),
        }
        async with self.deps.sessions() as session:
            bound = (
                await session.execute(
                    select(Node.id, Node.hostname)
                    .join(NodeMaasState, NodeMaasState.node_id == Node.id)
                    .where(
                        NodeMaasState.site_id == site_id,
                        NodeMaasState.maas_system_id == machine.system_id,
                        Node.status != NodeStatus.DELETED,
                        Node.id != node_id,
                    )
                )
            ).first()
            holder = await _live_holder(session, site_id, machine.system_id, run.onboarding_id)
        if bound is not None:
            seen.update(bound_node_id=str(bound.id), bound_hostname=bound.hostname)
        if holder is not None:
            seen.update(holder_onboarding_id=str(holder.onboarding_id))
        return seen

    async def _cycled_before(self, run: StageRun, address: str) -> bool:
        """This job power-cycled the BMC at `address` in an earlier attempt (its own recorded
        check): a chassis found on now is that cycle's boot, not a stranger's host."""
        async with self.deps.sessions() as session:
            found = await session.scalar(
                select(NodeOnboardingEvent.id)
                .where(
                    NodeOnboardingEvent.onboarding_id == run.onboarding_id,
                    NodeOnboardingEvent.stage == Stage.CREATE_OR_FIND_IN_MAAS.value,
                    NodeOnboardingEvent.details["bmc_check"]["address"].astext == address,
                    NodeOnboardingEvent.details["bmc_check"]["verdict"].astext == "ok",
                )
                .limit(1)
            )
        return found is not None

    async def _record_bmc_check(self, run: StageRun, evidence: dict[str, Any]) -> None:
        """The check, in the job's timeline before the cycle is sent."""
        async with self.deps.sessions() as session, session.begin():
            await read_model.add_event(
                session,
                run.onboarding_id,
                stage=Stage.CREATE_OR_FIND_IN_MAAS.value,
                attempt=run.input.attempt,
                status="started",
                message=(
                    f"BMC {evidence['address']} checked (chassis {evidence['power']}, "
                    f"MAAS record {evidence['record']}); power-cycling"
                ),
                details={"bmc_check": evidence},
            )

    @staticmethod
    async def _new_machines(maas: MaasClient, *, exclude: Machine | None) -> list[Machine]:
        """The New machines MAAS could commission, other than `exclude` (our own record)."""
        skip = exclude.system_id if exclude is not None else None
        return [
            m
            for m in await maas.list_machines(statuses=[S.NEW])
            if m.system_id != skip and _usable(m)
        ]

    # ------------------------------------------------------------------ commissioning

    @activity.defn(name="onboarding.commission_node")
    async def commission_node(self, input: StageInput) -> StageResult:
        async with self.stage(input, Stage.COMMISSION_NODE) as run, self.maas(run.site) as maas:
            machine = await get_machine_or_ambiguity(maas, run.system_id)
            state = observe(input.state, machine)
            if machine.status == S.READY:
                # No commissioning to set the power parameters on the way: a per-node override
                # (docs/maas-sites.md#power-credential-overrides) is written now, or MAAS would go
                # on powering the machine with the credentials it had (the site default's, or stale
                # ones).
                login, source = await self._bmc_login(run)
                if source.startswith(OVERRIDE_SOURCE_PREFIX):
                    await maas.update_machine(machine.system_id, power=_ipmi_power(login))
                    run.skipped(state, f"already Ready; power credentials from {source} set")
                else:
                    run.skipped(state, "already Ready")
            elif machine.status in DEPLOY_BOUND:
                run.skipped(state, f"already {machine.status.label}")
            elif machine.status in COMMISSION_ACTIVE:
                run.skipped(state, "already commissioning; waiting")
            else:
                login, _ = await self._bmc_login(run)
                if machine.status == S.NEW:
                    await maas.accept_machines(machine.system_id)
                await maas.update_machine(
                    machine.system_id,
                    hostname=input.onboarding.hostname,
                    power=_ipmi_power(login),
                )
                if machine.status != S.NEW:
                    await maas.commission(machine.system_id, enable_ssh=True, skip_bmc_config=True)
                machine = await maas.get_machine(machine.system_id)
                run.done(observe(state, machine), f"commissioning from {machine.status.label}")
        assert run.result is not None
        return run.result

    @activity.defn(name="onboarding.wait_for_ready")
    async def wait_for_ready(self, input: StageInput) -> StageResult:
        async with self.stage(input, Stage.WAIT_FOR_READY) as run:
            site = run.site
            async with self.maas(site) as maas:
                last: list[Machine] = []

                async def check() -> Machine | None:
                    machine = await get_machine_or_ambiguity(maas, run.system_id)
                    last[:] = [machine]
                    if machine.status == S.READY or machine.status in DEPLOY_BOUND:
                        return machine
                    if machine.status in COMMISSION_FAILED:
                        raise StageError(
                            FailureClass.HARDWARE_MISMATCH,
                            "failed_commission",
                            f"commissioning ended in {machine.status.label}: "
                            f"{machine.error_description or machine.status_message}",
                            details={"maas_status": machine.status.label},
                            non_retryable=True,
                        )
                    return None

                machine = await poll_until(
                    site,
                    site.policy.commission_timeout_seconds,
                    check,
                    progress=lambda: {"maas_status": last[0].status.label if last else None},
                )
                if machine is None:
                    raise timeout_error(
                        "commission",
                        "the machine did not reach Ready in time",
                        maas_status=last[0].status.label if last else None,
                    )
                run.done(observe(input.state, machine), f"machine is {machine.status.label}")
        assert run.result is not None
        return run.result

    # ------------------------------------------------------------------ storage

    @activity.defn(name="onboarding.configure_storage")
    async def configure_storage(self, input: StageInput) -> StageResult:
        async with self.stage(input, Stage.CONFIGURE_STORAGE) as run, self.maas(run.site) as maas:
            machine = await get_machine_or_ambiguity(maas, run.system_id)
            state = observe(input.state, machine)
            if machine.status in DEPLOY_BOUND:
                run.skipped(state, f"storage is fixed once {machine.status.label}")
            elif machine.status != S.READY:
                raise _ambiguity(
                    "not_ready_for_storage",
                    f"storage can only be set on a Ready machine, not {machine.status.label}",
                )
            else:
                disks = await maas.list_block_devices(machine.system_id)
                boss = [
                    d
                    for d in disks
                    if d.type == "physical"
                    and any(BOSS_PATTERN.search(v or "") for v in (d.model, d.name, d.id_path))
                ]
                if not boss:
                    raise StageError(
                        FailureClass.HARDWARE_MISMATCH,
                        "boss_disk_missing",
                        "no BOSS boot disk (model/name/id_path matching boss, boot "
                        "optimized or m.2)",
                        details={"disks": [f"{d.name}:{d.model}" for d in disks][:20]},
                        non_retryable=True,
                    )
                disk = boss[0]
                await maas.apply_flat_layout(machine.system_id, disk.id)
                state.boss_disk_id = disk.id
                run.done(state, f"flat layout on {disk.name} ({disk.model})", disk=disk.name)
        assert run.result is not None
        return run.result

    # ------------------------------------------------------------------ RoCE phase 2

    @activity.defn(name="onboarding.apply_roce_phase2")
    async def apply_roce_phase2(self, input: StageInput) -> StageResult:
        """Each assigned /31 is created on the VLAN MAAS reports for the RoCE NIC (its fabric)
        and linked STATIC. A link that does not apply (MAAS refuses it, the NIC is missing)
        makes the stage FAILED in the read model with its failure class, error code and the
        count of links that did apply; whether that stops the job is the policy's call
        (`roce_failures_stop_job`): by default it does not (§4.6, RoCE phase 2 is non-fatal)
        and the workflow goes on with this stage's result."""
        outcome: StageResult | None = None
        try:
            async with self.stage(input, Stage.APPLY_ROCE_PHASE2) as run:
                site, state = run.site, input.state
                if not site.policy.enable_phase2_roce:
                    run.skipped(state, "phase-2 RoCE is off for this profile")
                else:
                    assignments = await self._roce_rows(site, input.onboarding.hostname)
                    if not assignments:
                        run.skipped(state, "no RoCE assignments for this hostname")
                    else:
                        await self._apply_roce(run, assignments)
                outcome = run.result
        except ApplicationError as err:
            cause = err.__cause__
            if not isinstance(cause, RoceLinksFailed) or cause.stops_job:
                raise
            outcome = cause.result
        assert outcome is not None
        return outcome

    async def _roce_rows(self, site: SiteConfig, hostname: str) -> list[tuple[str, str]]:
        async with self.deps.sessions() as session:
            rows = await session.execute(
                select(MaasRoceAssignment.interface, MaasRoceAssignment.ipv4_cidr).where(
                    MaasRoceAssignment.site_id == uuid.UUID(site.site_id),
                    MaasRoceAssignment.hostname == hostname,
                )
            )
            return [(i, c) for i, c in rows.all()]

    async def _apply_roce(self, run: StageRun, assignments: list[tuple[str, str]]) -> None:
        state = run.input.state
        failed: list[dict[str, Any]] = []
        applied = 0
        async with self.maas(run.site) as maas:
            machine = await get_machine_or_ambiguity(maas, run.system_id)
            if machine.status in DEPLOY_BOUND:
                run.skipped(
                    state,
                    f"interfaces are fixed once {machine.status.label}",
                    links_applied=state.roce_applied,
                )
                return
            interfaces = {i.name: i for i in await maas.list_interfaces(machine.system_id)}
            for name, cidr in assignments:
                try:
                    if await self._apply_roce_link(maas, machine.system_id, interfaces, name, cidr):
                        applied += 1
                except ClassifiedError as err:
                    failed.append(_link_failure(name, cidr, err))
                except ValueError as err:  # an assignment that is not an address/prefix
                    failed.append(
                        _link_failure(
                            name,
                            cidr,
                            StageError(FailureClass.INPUT_CONFIG_ERROR, "roce_bad_cidr", str(err)),
                        )
                    )
        state.roce_applied = applied
        total = len(assignments)
        if not failed:
            run.done(state, f"{applied} RoCE link(s) in place", links_applied=applied)
            return
        first = failed[0]
        message = (
            f"{applied} of {total} RoCE link(s) in place; {len(failed)} failed "
            f"({first['interface']}: {first['error']})"
        )
        result = run.done(
            state, message, links_applied=applied, links_total=total, links_failed=failed
        )
        error = RoceLinksFailed(
            FailureClass(first["failure_class"]),
            first["error_code"],
            message,
            details={"links_applied": applied, "links_total": total},
            non_retryable=True,
        )
        error.result = result
        error.stops_job = run.site.policy.roce_failures_stop_job
        raise error

    async def _apply_roce_link(
        self,
        maas: MaasClient,
        system_id: str,
        interfaces: dict[str, Interface],
        name: str,
        cidr: str,
    ) -> bool:
        """One assignment: True once its STATIC link is in place. The /31 is created on the
        interface's VLAN (MAAS only links a subnet on the interface's VLAN, without force);
        an existing subnet of that CIDR is used as it is, and MAAS decides."""
        address = ipaddress.ip_interface(cidr)
        iface = interfaces.get(name)
        if iface is None:
            raise StageError(
                FailureClass.HARDWARE_MISMATCH,
                "roce_interface_missing",
                f"the machine has no interface {name}",
            )
        ip = str(address.ip)
        if any(link.ip_address == ip for link in iface.links):
            return True
        network = str(address.network)
        subnet = await maas.find_subnet_by_cidr(network)
        if subnet is None:
            subnet = await maas.create_subnet(
                network, vlan_id=iface.vlan.id if iface.vlan is not None else None
            )
        updated = await maas.link_subnet(
            system_id, iface.id, mode=LinkMode.STATIC, subnet=subnet.id, ip_address=ip
        )
        interfaces[name] = updated
        return True

    # ------------------------------------------------------------------ PXE interface

    @activity.defn(name="onboarding.ensure_pxe_interface_auto")
    async def ensure_pxe_interface_auto(self, input: StageInput) -> StageResult:
        async with self.stage(input, Stage.ENSURE_PXE_INTERFACE_AUTO) as run:
            site = run.site
            async with self.maas(site) as maas:
                machine = await get_machine_or_ambiguity(maas, run.system_id)
                state = observe(input.state, machine)
                if machine.status in DEPLOY_BOUND:
                    run.skipped(state, f"interfaces are fixed once {machine.status.label}")
                else:
                    await self._ensure_pxe(run, maas, machine)
        assert run.result is not None
        return run.result

    async def _ensure_pxe(self, run: StageRun, maas: MaasClient, machine: Machine) -> None:
        site, state = run.site, run.input.state
        interfaces = await maas.list_interfaces(machine.system_id)
        iface = next((i for i in interfaces if i.name == site.node_pxe_iface), None)
        if iface is None:
            raise StageError(
                FailureClass.HARDWARE_MISMATCH,
                "pxe_interface_missing",
                f"the machine has no interface {site.node_pxe_iface}",
                details={"interfaces": [i.name for i in interfaces]},
                non_retryable=True,
            )
        if _pxe_ok(iface):
            run.skipped(state, f"{iface.name} already has an AUTO/DHCP subnet link")
            return
        subnet_id = await self._pxe_subnet(maas, site, iface)
        problem = None
        if subnet_id is None:
            problem = f"no subnet on the PXE VLAN {site.pxe_vlan_vid} for {iface.name}"
        else:
            for link in iface.links:
                iface = await maas.unlink_subnet(machine.system_id, iface.id, link.id)
            iface = await maas.link_subnet(
                machine.system_id, iface.id, mode=LinkMode.AUTO, subnet=subnet_id
            )
            if not _pxe_ok(iface):
                problem = f"{iface.name} still has no AUTO/DHCP link after relinking"
        if problem is None:
            run.done(state, f"{iface.name} relinked AUTO", subnet_id=subnet_id)
        elif site.policy.strict_pxe_preflight:
            raise StageError(
                FailureClass.HARDWARE_MISMATCH, "pxe_preflight_failed", problem, non_retryable=True
            )
        else:
            run.done(state, f"warning (strict preflight off): {problem}", warning=problem)

    async def _pxe_subnet(self, maas: MaasClient, site: SiteConfig, iface: Interface) -> int | None:
        for link in iface.links:
            if link.subnet is not None:
                return link.subnet.id
        for subnet in await maas.list_subnets():
            if subnet.vlan is not None and subnet.vlan.vid == site.pxe_vlan_vid:
                return subnet.id
        return None

    # ------------------------------------------------------------------ deploy outcome

    @activity.defn(name="onboarding.wait_for_deployed")
    async def wait_for_deployed(self, input: StageInput) -> StageResult:
        async with self.stage(input, Stage.WAIT_FOR_DEPLOYED) as run:
            site = run.site
            async with self.maas(site) as maas:
                last: list[Machine] = []

                async def check() -> Machine | None:
                    machine = await get_machine_or_ambiguity(maas, run.system_id)
                    last[:] = [machine]
                    if machine.status == S.DEPLOYED:
                        return machine
                    if machine.status == S.FAILED_DEPLOYMENT:
                        raise StageError(
                            FailureClass.DEPLOY_CLOUD_INIT_FAILURE,
                            "deploy_failed",
                            f"deployment failed: {machine.error_description}",
                            details={"maas_status": machine.status.label},
                            non_retryable=True,
                        )
                    if machine.status not in (S.DEPLOYING, S.ALLOCATED):
                        raise _ambiguity(
                            "left_deploy_out_of_band",
                            f"the machine went {machine.status.label} while deploying",
                            maas_status=machine.status.label,
                        )
                    return None

                machine = await poll_until(
                    site,
                    site.policy.deploy_timeout_seconds,
                    check,
                    progress=lambda: {"maas_status": last[0].status.label if last else None},
                )
                if machine is None:
                    raise timeout_error("deploy", "the machine did not reach Deployed in time")
                before, host = await self._set_host_address(run, machine)
                details: dict[str, Any] = {"ips": list(machine.ip_addresses), "host": host}
                if before != host:
                    details["previous_host"] = before
                run.done(observe(input.state, machine), "deployed", **details)
        assert run.result is not None
        return run.result

    async def _set_host_address(
        self, run: StageRun, machine: Machine
    ) -> tuple[str | None, str | None]:
        """The node's host address from the machine's deployed IPs (onboarding and reimage
        both pass here), so the reconciler's ip_changed means a real change: (before, after).
        Nothing happens while the node record does not exist yet or MAAS shows no address."""
        node_id = uuid.UUID(run.input.onboarding.node_id)
        async with self.deps.sessions() as session, session.begin():
            current = await session.scalar(
                select(Node.host_address).where(Node.id == node_id).with_for_update()
            )
            host = deployed_host(machine, run.site.deploy_ssh_iface, current)
            if host is not None and host != current:
                await session.execute(
                    update(Node)
                    .where(Node.id == node_id)
                    .values(host_address=host, updated_at=func.now())
                )
        return current, host if host is not None else current

    @activity.defn(name="onboarding.classify_deploy_failure")
    async def classify_deploy_failure(self, input: StageInput) -> StageResult:
        """datasource_like | generic, from the machine and its recent MAAS events. Best effort:
        if MAAS cannot tell, the failure is generic and automatic retry stops (§4.6)."""
        async with self.stage(input, Stage.CLASSIFY_DEPLOY_FAILURE) as run:
            verdict, evidence = "generic", ""
            try:
                async with self.maas(run.site) as maas:
                    machine = await get_machine_or_ambiguity(maas, run.system_id)
                    observe(input.state, machine)
                    events = await maas.query_events(
                        system_id=machine.system_id, level="DEBUG", limit=50
                    )
                texts = [e.description for e in events[:30]] + [machine.error_description]
                hit = next((t for t in texts if DATASOURCE_PATTERN.search(t or "")), None)
                if hit is not None:
                    verdict, evidence = "datasource_like", hit
            except Exception as err:  # best effort by contract
                evidence = f"classification failed: {type(err).__name__}"
            run.done(input.state, verdict, failure_kind=verdict, evidence=evidence[:300])
        assert run.result is not None
        return run.result

    @activity.defn(name="onboarding.recover_for_datasource_retry")
    async def recover_for_datasource_retry(self, input: StageInput) -> StageResult:
        stage = Stage.RECOVER_FOR_DATASOURCE_RETRY
        async with self.stage(input, stage) as run, self.maas(run.site) as maas:
            machine = await release_to_ready(maas, run.site, run.system_id)
            run.done(observe(input.state, machine), "released back to Ready for a redeploy")
        assert run.result is not None
        return run.result


async def release_to_ready(maas: MaasClient, site: SiteConfig, system_id: str) -> Machine:
    """Abort a deploy in progress, release, and wait until MAAS shows Ready (§4.6 deploy
    compensation). Ready already: nothing to do."""
    machine = await get_machine_or_ambiguity(maas, system_id)
    if machine.status == S.DEPLOYING:
        machine = await maas.abort(system_id, comment="gpucloud onboarding: redeploy")
    if machine.status in RELEASABLE:
        await maas.release(system_id, erase=EraseMode.NONE, comment="gpucloud onboarding")

    async def check() -> Machine | None:
        current = await get_machine_or_ambiguity(maas, system_id)
        if current.status == S.READY:
            return current
        if current.status.is_failure and current.status not in RELEASABLE:
            raise StageError(
                FailureClass.STATE_AMBIGUITY,
                "release_failed",
                f"release ended in {current.status.label}",
                non_retryable=True,
            )
        return None

    ready = await poll_until(site, site.policy.deploy_timeout_seconds, check)
    if ready is None:
        raise StageError(
            FailureClass.STATE_AMBIGUITY,
            "release_timeout",
            "the machine did not come back to Ready after release",
            non_retryable=True,
        )
    return ready


def deployed_host(machine: Machine, ssh_iface: str, current: str | None) -> str | None:
    """The address a deployed machine is reached at: the current one while MAAS still shows it,
    else the deploy SSH interface's address, else MAAS's first. None: MAAS shows no address."""
    ips = machine.ip_addresses
    if not ips:
        return None
    if current in ips:
        return current
    iface = machine.interface_named(ssh_iface)
    for link in iface.links if iface is not None else ():
        if link.ip_address and str(link.ip_address) in ips:
            return str(link.ip_address)
    return ips[0]


async def _delete_placeholder(maas: MaasClient, system_id: str) -> bool:
    """Delete the IPMI-only record discovery made (or found) for this node, once another
    record turned out to be the machine; only while it is still New without interfaces."""
    try:
        current = await maas.get_machine(system_id)
    except MaasNotFound:
        return False
    if current.status != S.NEW or current.interfaces:
        return False
    await maas.delete_machine(system_id)
    return True


def _placeholder(machine: Machine) -> bool:
    """An IPMI-only New record nobody owns: what discovery makes for a BMC."""
    return machine.status == S.NEW and not machine.owner and not _usable(machine)


def _taken(seen: dict[str, Any]) -> bool:
    return bool(seen.get("bound_node_id") or seen.get("holder_onboarding_id"))


def _ipmi_power(login: BmcLogin) -> IpmiPowerParameters:
    """The power parameters MAAS is given for the node's BMC (its address, the resolved login)."""
    return IpmiPowerParameters(
        power_address=login.address, power_user=login.user, power_pass=login.password
    )


def _usable(machine: Machine) -> bool:
    """MAAS can commission it: it has interfaces (an IPMI-only New record has none)."""
    return machine.status != S.NEW or bool(machine.interfaces)


def _pxe_ok(iface: Interface) -> bool:
    return any(
        link.mode in (LinkMode.AUTO, LinkMode.DHCP) and link.subnet is not None
        for link in iface.links
    )


def _with_system(input: StageInput, machine: Machine) -> OnboardState:
    state = input.state
    state.system_id = machine.system_id
    return state


class RoceLinksFailed(StageError):
    """Some RoCE links did not apply. Raised inside the stage so that its event is recorded
    FAILED with the class; `stops_job` False: the stage then answers `result` (non-fatal)."""

    result: StageResult | None = None
    stops_job: bool = False


def _link_failure(name: str, cidr: str, err: ClassifiedError) -> dict[str, Any]:
    refused = getattr(err, "status_code", None) == 400
    code = err.error_code if isinstance(err, StageError) else (
        "roce_link_refused" if refused else "roce_link_failed"
    )  # fmt: skip
    failure: dict[str, Any] = {
        "interface": name,
        "cidr": cidr,
        "failure_class": err.failure_class.value,
        "error_code": code,
        "error": str(err.message)[:300],
    }
    field_errors = getattr(err, "field_errors", None)
    if field_errors:
        failure["maas_field_errors"] = {k: list(v) for k, v in field_errors.items()}
    if getattr(err, "status_code", None) is not None:
        failure["maas_status_code"] = err.status_code  # type: ignore[attr-defined]
    return failure
