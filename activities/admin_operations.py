"""The admin operations AdminOperationWorkflow runs (contracts/admin_operation.py): each
a single-purpose activity that writes its change and the audit row in ONE transaction, and
answers a refusal as a non-retryable ApplicationError whose type is the API's error code.

MAAS and Vault calls happen here, never in the gateway. A credentials change is validated
against MAAS before anything is written; its Vault writes are undone (each path back to what it
held) when a later write or the database commit fails, so a failure leaves the previous
credentials in place. No secret value reaches a log line, an error message or an audit row.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import sqlalchemy.exc
from sqlalchemy import func, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.billing.accounts import balance_minor
from activities.billing.ledger import EntryKind, post_entry
from activities.maas.client import MaasClient
from activities.maas.errors import MaasAuthError, MaasError, MaasNotAdmin
from activities.operation_support import (
    SecretChanges,
    record_audit,
    refusal,
    transaction,
    undone_on_failure,
    vault_refusal,
)
from contracts.admin_operation import (
    BILLING_CREDIT,
    CREDENTIALS_INVALID,
    CREDENTIALS_MISSING,
    DRIFT_RESOLVE,
    GPU_SLOT_RETURN,
    MAAS_API_KEY_MALFORMED,
    MAAS_TOKEN_NOT_ADMIN,
    MAAS_TOKEN_REJECTED,
    MAAS_UNREACHABLE,
    NO_DRIFT,
    NOT_FOUND,
    OVERRIDE_EXISTS,
    POWER_OVERRIDE_CREATE,
    POWER_OVERRIDE_DELETE,
    POWER_OVERRIDE_UPDATE,
    ROCE_DELETE,
    ROCE_UPSERT,
    SITE_CREDENTIALS_WRITE,
    SITE_PROBE,
    SLOT_NOT_QUARANTINED,
    CreditInput,
    CreditResult,
    DriftResolveInput,
    DriftState,
    GpuSlotReturnInput,
    GpuSlotState,
    PowerOverrideCreateInput,
    PowerOverrideDeleteInput,
    PowerOverrideState,
    PowerOverrideUpdateInput,
    RackController,
    RoceDeleteInput,
    RoceUpsertInput,
    RoceUpsertResult,
    SiteCredentialsInput,
    SiteCredentialsResult,
    SiteProbeInput,
    SiteProbeResult,
    ledger_idempotency_key,
)
from contracts.states import SlotStatus
from core.failures import FailureClass
from core.secret_paths import power_override_path
from core.secrets import SecretStore, SecretStoreError
from schema.constraints import constraint_name
from schema.models import (
    GpuSlot,
    MaasPowerCredentialOverride,
    MaasRoceAssignment,
    MaasSite,
    Node,
    NodeMaasState,
    Project,
)

log = logging.getLogger(__name__)

# The credentials check answers an operator promptly, whatever MAAS is doing: one attempt.
MAAS_CHECK_TIMEOUT_SECONDS = 5.0
# A probe (two reads, each retried) ends within this, inside the gateway's wait for the answer.
MAAS_PROBE_DEADLINE_SECONDS = 8.0


# --- answers ------------------------------------------------------------------------------------


def _maas_refusal(err: MaasError) -> ApplicationError:
    """MAAS said no or did not answer: a typed answer that names the failure class."""
    details: dict[str, Any] = {"failure_class": err.failure_class.value}
    if isinstance(err, MaasNotAdmin):
        details["maas_username"] = err.username
        return refusal(MAAS_TOKEN_NOT_ADMIN, err.message, details)
    if isinstance(err, MaasAuthError):
        return refusal(MAAS_TOKEN_REJECTED, "MAAS rejected the API key", details)
    return refusal(
        MAAS_UNREACHABLE, "MAAS did not answer (unreachable, timed out or failing)", details
    )


def _iso(value: dt.datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


# --- Vault writes that can be undone ------------------------------------------------------------


class AdminOperationActivities:
    def __init__(self, sessions: async_sessionmaker[AsyncSession], secrets: SecretStore) -> None:
        self._sessions = sessions
        self._secrets = secrets

    def activities(self) -> list[Callable[..., Any]]:
        """Every admin operation, for the worker's registration."""
        return [
            self.billing_credit,
            self.gpu_slot_return_to_service,
            self.drift_resolve,
            self.site_credentials_write,
            self.site_probe,
            self.roce_upsert,
            self.roce_delete,
            self.power_override_create,
            self.power_override_update,
            self.power_override_delete,
        ]

    async def _site(self, site_id: str) -> MaasSite:
        async with transaction(self._sessions) as session:
            site = await session.get(MaasSite, uuid.UUID(site_id))
            if site is None:
                raise refusal(NOT_FOUND, "MAAS site not found")
            session.expunge(site)
            return site

    # --- billing ---------------------------------------------------------------------------------

    @activity.defn(name=BILLING_CREDIT)
    async def billing_credit(self, input: CreditInput) -> CreditResult:
        """Post the credit once (the ledger's key is unique), audited when this call posted it."""
        project_id = uuid.UUID(input.project_id)
        async with transaction(self._sessions) as session:
            if await session.get(Project, project_id) is None:
                raise refusal(NOT_FOUND, "project not found")
            entry_id, created = await post_entry(
                session,
                project_id=project_id,
                amount_minor=input.amount_minor,
                kind=EntryKind.ADMIN_CREDIT,
                idempotency_key=ledger_idempotency_key(input.project_id, input.idempotency_key),
                description=input.actor.reason,
            )
            if created:
                record_audit(
                    session,
                    input.actor,
                    action="billing.credit",
                    target_type="project",
                    target_id=str(project_id),
                    details={"amount_minor": input.amount_minor, "entry_id": str(entry_id)},
                )
            balance = await balance_minor(session, project_id)
        return CreditResult(entry_id=str(entry_id), created=created, balance_minor=balance)

    # --- GPU slots -------------------------------------------------------------------------------

    @activity.defn(name=GPU_SLOT_RETURN)
    async def gpu_slot_return_to_service(self, input: GpuSlotReturnInput) -> GpuSlotState:
        """disabled (quarantined) → free, compare-and-set, audited."""
        slot_id, node_id = uuid.UUID(input.slot_id), uuid.UUID(input.node_id)
        async with transaction(self._sessions) as session:
            slot = await session.get(GpuSlot, slot_id)
            if slot is None or slot.node_id != node_id:
                raise refusal(NOT_FOUND, "GPU slot not found")
            prior_reason = slot.quarantine_reason
            returned = await session.scalar(
                update(GpuSlot)
                .where(
                    GpuSlot.id == slot_id,
                    GpuSlot.status == SlotStatus.DISABLED,
                    GpuSlot.quarantine_reason.is_not(None),
                )
                .values(
                    status=SlotStatus.FREE,
                    quarantine_reason=None,
                    quarantined_at=None,
                    updated_at=func.clock_timestamp(),
                )
                .returning(GpuSlot)
                .execution_options(populate_existing=True)
            )
            if returned is None:
                raise refusal(SLOT_NOT_QUARANTINED, "this GPU slot is not quarantined")
            record_audit(
                session,
                input.actor,
                action="gpu_slot.return_to_service",
                target_type="gpu_slot",
                target_id=str(slot_id),
                prior_state=SlotStatus.DISABLED.value,
                expected_state=SlotStatus.FREE.value,
                details={"node_id": str(node_id), "quarantine_reason": prior_reason},
            )
            return GpuSlotState(
                id=str(returned.id),
                gpu_index=returned.gpu_index,
                numa_node=returned.numa_node,
                pci_address=returned.pci_address,
                status=returned.status,
                allocation_id=str(returned.allocation_id) if returned.allocation_id else None,
                quarantine_reason=returned.quarantine_reason,
                quarantined_at=_iso(returned.quarantined_at),
            )

    # --- reconciliation --------------------------------------------------------------------------

    @activity.defn(name=DRIFT_RESOLVE)
    async def drift_resolve(self, input: DriftResolveInput) -> DriftState:
        """An operator acknowledges a drift after acting on it: compare-and-set, audited."""
        node_id = uuid.UUID(input.node_id)
        async with transaction(self._sessions) as session:
            state = await session.get(NodeMaasState, node_id)
            if state is None:
                raise refusal(NOT_FOUND, "node is not bound to a MAAS site")
            rule = state.drift_rule
            resolved = await session.scalar(
                update(NodeMaasState)
                .where(NodeMaasState.node_id == node_id, NodeMaasState.drift_detected)
                .values(drift_detected=False, drift_resolved_at=func.clock_timestamp())
                .returning(NodeMaasState)
                .execution_options(populate_existing=True)
            )
            if resolved is None:
                raise refusal(NO_DRIFT, "this node has no unresolved drift")
            record_audit(
                session,
                input.actor,
                action="reconciliation.resolve_drift",
                target_type="node",
                target_id=str(node_id),
                prior_state="drift_detected",
                expected_state="resolved",
                details={"rule": rule},
            )
            node = await session.get(Node, node_id)
            assert node is not None  # node_maas_state.node_id references nodes
            return DriftState(
                node_id=str(node_id),
                hostname=node.hostname,
                node_status=node.status,
                site_id=str(resolved.site_id),
                maas_system_id=resolved.maas_system_id,
                rule=resolved.drift_rule,
                details=resolved.drift_details,
                last_maas_status=resolved.last_maas_status,
                last_reconciled_at=_iso(resolved.last_reconciled_at),
            )

    # --- MAAS site credentials and probe --------------------------------------------------------

    @activity.defn(name=SITE_CREDENTIALS_WRITE)
    async def site_credentials_write(self, input: SiteCredentialsInput) -> SiteCredentialsResult:
        """MAAS accepts the key and it is an admin's (users/?op=whoami; else 422
        maas_token_not_admin) → the secrets go to Vault → the site row and the audit row commit.
        No transaction is open across the MAAS and Vault calls; a failure after a Vault write
        puts every written path back as it was."""
        site = await self._site(input.site_id)
        try:
            async with MaasClient(
                site.api_base_url,
                input.maas_api_key,
                timeout=MAAS_CHECK_TIMEOUT_SECONDS,
                max_attempts=1,
            ) as maas:
                version = await maas.version()
                await maas.require_admin()
        except ValueError:
            raise refusal(
                MAAS_API_KEY_MALFORMED,
                "maas_api_key must be '<consumer_key>:<token_key>:<token_secret>'",
            ) from None
        except MaasError as err:
            raise _maas_refusal(err) from None

        writes: list[tuple[str, Mapping[str, str]]] = [
            (site.api_token_vault_path, {"token": input.maas_api_key})
        ]
        if input.power is not None:
            writes.append(
                (
                    site.default_power_creds_vault_path,
                    {"user": input.power.user, "pass": input.power.password},
                )
            )
        if input.deploy_password is not None:
            writes.append((site.deploy_password_vault_path, {"password": input.deploy_password}))
        written = [path for path, _ in writes]
        changes = SecretChanges(self._secrets)
        await changes.write(writes)
        async with undone_on_failure(changes), transaction(self._sessions) as session:
            updated = await session.scalar(
                update(MaasSite)
                .where(MaasSite.id == site.id)
                .values(
                    credentials_updated_at=func.now(),
                    maas_version=version.version,
                    updated_at=func.now(),
                )
                .returning(MaasSite.id)
            )
            if updated is None:  # deleted meanwhile: the secrets are put back
                raise refusal(NOT_FOUND, "MAAS site not found")
            record_audit(
                session,
                input.actor,
                action="maas_site.credentials_write",
                target_type="maas_site",
                target_id=str(site.id),
                details={"written_paths": written, "maas_version": version.version},
            )
        return SiteCredentialsResult(
            site_id=str(site.id), maas_version=version.version, written_paths=written
        )

    @activity.defn(name=SITE_PROBE)
    async def site_probe(self, input: SiteProbeInput) -> SiteProbeResult:
        """MAAS with the stored token, read from Vault now (a rotated token is used at once);
        the token must still be an admin's (422 maas_token_not_admin)."""
        site = await self._site(input.site_id)
        try:
            secret = await self._secrets.read(site.api_token_vault_path)
        except SecretStoreError as err:
            raise vault_refusal(err) from None
        if not secret or not secret.get("token"):
            raise refusal(
                CREDENTIALS_MISSING, "this site has no MAAS credentials yet (POST …/credentials)"
            )
        try:
            async with (
                asyncio.timeout(MAAS_PROBE_DEADLINE_SECONDS),
                MaasClient(
                    site.api_base_url, secret["token"], timeout=MAAS_CHECK_TIMEOUT_SECONDS
                ) as maas,
            ):
                version = await maas.version()
                await maas.require_admin()
                racks = await maas.rack_controllers()
        except ValueError:
            raise refusal(
                CREDENTIALS_INVALID, "the stored MAAS API key is malformed; write new credentials"
            ) from None
        except MaasError as err:
            raise _maas_refusal(err) from None
        except TimeoutError:
            raise refusal(
                MAAS_UNREACHABLE,
                "MAAS did not answer (unreachable, timed out or failing)",
                {"failure_class": FailureClass.UPSTREAM_TRANSIENT.value},
            ) from None
        return SiteProbeResult(
            site_id=str(site.id),
            maas_version=version.version,
            subversion=version.subversion,
            capabilities=sorted(version.capabilities),
            rack_controllers=[
                RackController(system_id=r.system_id, hostname=r.hostname, version=r.version)
                for r in racks
            ],
        )

    # --- RoCE assignments -------------------------------------------------------------------------

    @activity.defn(name=ROCE_UPSERT)
    async def roce_upsert(self, input: RoceUpsertInput) -> RoceUpsertResult:
        """Bulk upsert, idempotent on site + hostname + interface; audited when a row changed."""
        site_id = uuid.UUID(input.site_id)
        rows = [
            {
                "id": uuid.uuid4(),
                "site_id": site_id,
                "hostname": item.hostname,
                "interface": item.interface,
                "ipv4_cidr": item.ipv4_cidr,
            }
            for item in input.items
        ]
        async with transaction(self._sessions) as session:
            if await session.get(MaasSite, site_id) is None:
                raise refusal(NOT_FOUND, "MAAS site not found")
            insert = pg_insert(MaasRoceAssignment).values(rows)
            upsert = insert.on_conflict_do_update(
                constraint="roce_assignment_once",
                set_={"ipv4_cidr": insert.excluded.ipv4_cidr, "updated_at": func.now()},
                where=MaasRoceAssignment.ipv4_cidr != insert.excluded.ipv4_cidr,
            ).returning(text("(xmax = 0) AS inserted"))
            # xmax = 0 marks a freshly inserted row; rows whose value did not change are not
            # returned.
            results = (await session.execute(upsert)).all()
            created = sum(1 for (inserted,) in results if inserted)
            updated = len(results) - created
            unchanged = len(rows) - len(results)
            if results:
                record_audit(
                    session,
                    input.actor,
                    action="maas_site.roce_upsert",
                    target_type="maas_site",
                    target_id=str(site_id),
                    details={"created": created, "updated": updated, "unchanged": unchanged},
                )
        return RoceUpsertResult(created=created, updated=updated, unchanged=unchanged)

    @activity.defn(name=ROCE_DELETE)
    async def roce_delete(self, input: RoceDeleteInput) -> None:
        assignment_id = uuid.UUID(input.assignment_id)
        async with transaction(self._sessions) as session:
            row = await session.get(MaasRoceAssignment, assignment_id)
            if row is None or row.site_id != uuid.UUID(input.site_id):
                raise refusal(NOT_FOUND, "RoCE assignment not found")
            await session.delete(row)
            record_audit(
                session,
                input.actor,
                action="maas_site.roce_delete",
                target_type="maas_roce_assignment",
                target_id=str(assignment_id),
                details={
                    "site_id": input.site_id,
                    "hostname": row.hostname,
                    "interface": row.interface,
                },
            )

    # --- BMC power credential overrides ----------------------------------------------------------

    @staticmethod
    def _override_state(row: MaasPowerCredentialOverride) -> PowerOverrideState:
        return PowerOverrideState(
            id=str(row.id),
            site_id=str(row.site_id),
            selector_type=row.selector_type,
            selector_value=row.selector_value,
            vault_path=row.vault_path,
            status=row.status,
            created_at=row.created_at.isoformat(),
            updated_at=row.updated_at.isoformat(),
        )

    async def _override(
        self, session: AsyncSession, site_id: str, override_id: str
    ) -> MaasPowerCredentialOverride:
        row = await session.get(MaasPowerCredentialOverride, uuid.UUID(override_id))
        if row is None or row.site_id != uuid.UUID(site_id):
            raise refusal(NOT_FOUND, "power credential override not found")
        return row

    @activity.defn(name=POWER_OVERRIDE_CREATE)
    async def power_override_create(self, input: PowerOverrideCreateInput) -> PowerOverrideState:
        """The row is not committed until its secret is in Vault: a failed write leaves nothing
        (and a failed commit removes the secret again)."""
        site_id, override_id = uuid.UUID(input.site_id), uuid.UUID(input.override_id)
        vault_path = power_override_path(site_id, override_id)
        changes = SecretChanges(self._secrets)
        async with undone_on_failure(changes), transaction(self._sessions) as session:
            if await session.get(MaasSite, site_id) is None:
                raise refusal(NOT_FOUND, "MAAS site not found")
            row = MaasPowerCredentialOverride(
                id=override_id,
                site_id=site_id,
                selector_type=input.selector_type,
                selector_value=input.selector_value,
                vault_path=vault_path,
                status="active",
            )
            session.add(row)
            try:
                await session.flush()
            except sqlalchemy.exc.IntegrityError as err:
                if constraint_name(err) == "power_override_once":
                    raise refusal(
                        OVERRIDE_EXISTS, "an override for this selector already exists"
                    ) from None
                raise
            await changes.write([(vault_path, {"user": input.user, "pass": input.password})])
            record_audit(
                session,
                input.actor,
                action="maas_site.power_override_create",
                target_type="maas_power_override",
                target_id=str(override_id),
                expected_state="active",
                details={"site_id": str(site_id), "selector_type": row.selector_type},
            )
            await session.flush()
            await session.refresh(row)
            return self._override_state(row)

    @activity.defn(name=POWER_OVERRIDE_UPDATE)
    async def power_override_update(self, input: PowerOverrideUpdateInput) -> PowerOverrideState:
        """Rotate the override's secret and/or enable or disable it, audited."""
        changes = SecretChanges(self._secrets)
        async with undone_on_failure(changes), transaction(self._sessions) as session:
            row = await self._override(session, input.site_id, input.override_id)
            prior = row.status
            rotated = input.user is not None and input.password is not None
            if input.user is not None and input.password is not None:
                await changes.write(
                    [(row.vault_path, {"user": input.user, "pass": input.password})]
                )
            if input.status is not None:
                row.status = input.status
            row.updated_at = func.now()
            record_audit(
                session,
                input.actor,
                action="maas_site.power_override_update",
                target_type="maas_power_override",
                target_id=input.override_id,
                prior_state=prior,
                expected_state=input.status or prior,
                details={"rotated": rotated},
            )
            await session.flush()
            await session.refresh(row)
            return self._override_state(row)

    @activity.defn(name=POWER_OVERRIDE_DELETE)
    async def power_override_delete(self, input: PowerOverrideDeleteInput) -> None:
        """The secret first, then the commit: a failed delete leaves the override as it was (and
        a failed commit puts the secret back)."""
        changes = SecretChanges(self._secrets)
        async with undone_on_failure(changes), transaction(self._sessions) as session:
            row = await self._override(session, input.site_id, input.override_id)
            path, prior = row.vault_path, row.status
            await session.delete(row)
            record_audit(
                session,
                input.actor,
                action="maas_site.power_override_delete",
                target_type="maas_power_override",
                target_id=input.override_id,
                prior_state=prior,
                expected_state="deleted",
                details={"site_id": input.site_id},
            )
            await session.flush()
            await changes.delete(path)
