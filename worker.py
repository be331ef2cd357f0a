"""Control-plane Temporal worker: the lifecycle workflows and their PostgreSQL activities."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, TypedDict, Unpack

import uvloop
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from temporalio.client import Client
from temporalio.worker import Worker, WorkerConfig
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

from activities.admin_operations import AdminOperationActivities
from activities.allocation_groups import AllocationGroupActivities
from activities.allocations import AllocationActivities
from activities.billing.metering import BillingActivities
from activities.billing.notification_webhooks import NotificationWebhookActivities
from activities.billing.notifications import NotificationActivities
from activities.decommission.control_plane import DecommissionActivities, DecommissionDeps
from activities.decommission.reimage import ReimageActivities
from activities.enrollment_tokens import EnrollmentActivities
from activities.lifecycle_submissions import LifecycleSubmissionActivities
from activities.maas_reconcile import MaasReconcileActivities
from activities.node_admin import NodeAdminActivities
from activities.node_drain import NodeDrainActivities
from activities.node_liveness import NodeLivenessActivities
from activities.node_presence import NodePresenceActivities
from activities.node_task_log import NodeTaskLogActivities
from activities.onboarding.host_access import HostAccess
from activities.onboarding.maas_stages import MaasStageActivities
from activities.onboarding.node_stages import NodeStageActivities
from activities.onboarding.site_slots import SiteSlotActivities
from activities.onboarding.stage_runtime import OnboardingDeps
from activities.payments.activities import PaymentActivities
from activities.payments.schedule import ensure_stripe_reconciliation_schedule
from activities.payments.stripe_api import StripeApi
from activities.payments.webhook_events import StripeWebhookActivities
from activities.storage import StorageActivities
from activities.storage_provider import SharedDirectoryProvider
from activities.terminal_sessions import TerminalSessionActivities
from contracts.billing_meter import MeterInput
from contracts.node_liveness import LivenessInput
from core.config import Settings
from core.crash_traces import enable_crash_traces
from core.gc_tuning import tune_for_service
from core.payment_settings import NotificationSettings, PaymentSettings
from core.schedules import ensure_schedule, periodic_schedule
from core.secrets import SecretStore, VaultSecretStore
from core.temporal import connect, process_identity
from schema.db import create_engine, session_factory
from workflows.admin_operation import AdminOperationWorkflow
from workflows.allocation import AllocationWorkflow
from workflows.allocation_group import AllocationGroupWorkflow
from workflows.billing_meter import SCHEDULE_ID as BILLING_SCHEDULE_ID
from workflows.billing_meter import BillingMeterWorkflow
from workflows.decommission import NodeDecommissionWorkflow
from workflows.maas_reconciler import MaasSiteReconcilerWorkflow
from workflows.node_drain import NodeDrainWorkflow
from workflows.node_health_probe import NodeHealthProbeWorkflow
from workflows.node_liveness import SCHEDULE_ID as LIVENESS_SCHEDULE_ID
from workflows.node_liveness import NodeLivenessWorkflow
from workflows.node_presence import NodePresenceWorkflow
from workflows.onboarding import MaasNodeOnboardWorkflow
from workflows.onboarding_batch import MaasNodeBatchOnboardWorkflow
from workflows.payment_session import PaymentSessionWorkflow
from workflows.storage_attachment import StorageAttachmentWorkflow
from workflows.storage_namespace import StorageNamespaceDeleteWorkflow
from workflows.stripe_reconciliation import StripeReconciliationWorkflow
from workflows.terminal_session import TerminalSessionWorkflow

WORKFLOWS = [
    AllocationWorkflow,
    AllocationGroupWorkflow,
    NodePresenceWorkflow,
    MaasSiteReconcilerWorkflow,
    NodeLivenessWorkflow,
    BillingMeterWorkflow,
    PaymentSessionWorkflow,
    StripeReconciliationWorkflow,
    MaasNodeOnboardWorkflow,
    MaasNodeBatchOnboardWorkflow,
    NodeDecommissionWorkflow,
    AdminOperationWorkflow,
    NodeDrainWorkflow,
    TerminalSessionWorkflow,
    StorageAttachmentWorkflow,
    NodeHealthProbeWorkflow,
    StorageNamespaceDeleteWorkflow,
]

# Workflow modules stay sandboxed; every other module (our contracts, the SDK, the standard
# library) is passed through, so starting a workflow run does not re-import them. Determinism is
# still checked for the workflow code itself, and replay tests guard the rest.
WORKFLOW_RUNNER = SandboxedWorkflowRunner(
    restrictions=SandboxRestrictions.default.with_passthrough_all_modules()
)


class WorkerDependencies(TypedDict, total=False):
    """What a caller may put in place of the worker's defaults (each read from the
    environment when absent)."""

    task_queue: str | None
    secret_store: SecretStore | None
    stripe_api: StripeApi | None
    payment_settings: PaymentSettings | None
    host_access: HostAccess | None


def build_worker(
    client: Client,
    settings: Settings,
    engine: AsyncEngine,
    **dependencies: Unpack[WorkerDependencies],
) -> Worker:
    """The control-plane worker: every workflow and every control-plane activity."""
    return Worker(**worker_config(client, settings, engine, **dependencies))


def operation_activities(
    sessions: async_sessionmaker[AsyncSession], secret_store: SecretStore, client: Client
) -> list[Callable[..., Any]]:
    """Every operation AdminOperationWorkflow runs (contracts.admin_operation.OPERATIONS): the
    admin API's, and the other writes the gateway hands to the worker."""
    return [
        *AdminOperationActivities(sessions, secret_store).activities(),
        *EnrollmentActivities(sessions).activities(),
        *LifecycleSubmissionActivities(sessions, client).activities(),
        *StripeWebhookActivities(sessions, client).activities(),
        *NotificationWebhookActivities(sessions, secret_store).activities(),
        *NodeAdminActivities(sessions, client, secret_store).activities(),
        *StorageActivities(sessions, SharedDirectoryProvider.from_env(), client).operations(),
    ]


def worker_config(
    client: Client,
    settings: Settings,
    engine: AsyncEngine,
    **dependencies: Unpack[WorkerDependencies],
) -> WorkerConfig:
    """build_worker's arguments, for a test that splits them over two workers (one for the
    workflows, one for the activities)."""
    sessions = session_factory(engine)
    payment_settings = dependencies.get("payment_settings") or PaymentSettings.from_env()
    secret_store = dependencies.get("secret_store") or VaultSecretStore.from_settings(settings)
    stripe_api = dependencies.get("stripe_api") or StripeApi(secret_store, payment_settings)
    payments = PaymentActivities(sessions, stripe_api, payment_settings)
    allocations = AllocationActivities(engine)
    presence = NodePresenceActivities(sessions)
    maas_reconcile = MaasReconcileActivities(sessions, secret_store)
    liveness = NodeLivenessActivities(sessions, client)
    drain = NodeDrainActivities(sessions)
    billing = BillingActivities(sessions, client)
    storage_provider = SharedDirectoryProvider.from_env()
    host_access = dependencies.get("host_access")
    if host_access is None:
        from activities.onboarding.host_access_config import host_access_from_env

        host_access = host_access_from_env()
    onboarding_deps = OnboardingDeps(
        sessions,
        secret_store,
        host_access,
        settings.public_api_url,
        storage_export_root=str(storage_provider.root),
    )
    maas_stages = MaasStageActivities(onboarding_deps)
    node_stages = NodeStageActivities(onboarding_deps)
    site_slots = SiteSlotActivities(sessions)
    decommission = DecommissionActivities(
        DecommissionDeps(sessions, secret_store, host_access, settings.public_api_url, client)
    )
    reimage = ReimageActivities(onboarding_deps)
    return WorkerConfig(
        client=client,
        task_queue=dependencies.get("task_queue") or settings.control_plane_task_queue,
        build_id=settings.build_id,  # what the gateway's workflow starts expect (core.build_id)
        workflows=WORKFLOWS,
        workflow_runner=WORKFLOW_RUNNER,
        activities=[
            allocations.place,
            allocations.begin_provisioning,
            allocations.activate,
            allocations.fail_provisioning,
            allocations.begin_release,
            allocations.finish_release,
            allocations.detach,
            *AllocationGroupActivities(sessions, client).activities(),
            NodeTaskLogActivities(sessions).record_progress,
            *StorageActivities(sessions, storage_provider, client).activities(),
            presence.record_heartbeat,
            maas_reconcile.reconcile,
            maas_reconcile.record_reseeds,
            liveness.check_liveness,
            drain.drain_check,
            drain.drain_finish,
            billing.meter,
            billing.force_release,
            NotificationActivities(sessions, secret_store, NotificationSettings.from_env()).deliver,
            payments.create_checkout,
            payments.complete,
            payments.credit,
            payments.fail,
            payments.expire,
            payments.reconciliation_scan,
            node_stages.load_site_config,
            site_slots.acquire,
            site_slots.release,
            maas_stages.resolve_power_credentials,
            maas_stages.create_or_find_in_maas,
            maas_stages.commission_node,
            maas_stages.wait_for_ready,
            maas_stages.configure_storage,
            maas_stages.apply_roce_phase2,
            maas_stages.ensure_pxe_interface_auto,
            node_stages.render_cloud_init,
            node_stages.deploy_via_maas,
            maas_stages.wait_for_deployed,
            maas_stages.classify_deploy_failure,
            maas_stages.recover_for_datasource_retry,
            node_stages.ensure_hardware_sync_configured,
            node_stages.wait_for_hardware_sync_healthy,
            node_stages.wait_for_agent_enrollment,
            node_stages.refresh_enrollment_token,
            node_stages.observe_state,
            node_stages.activate_adopted,
            node_stages.compensate,
            node_stages.record_progress,
            decommission.disable_node,
            decommission.load_node,
            decommission.force_release_allocations,
            decommission.await_quiet_node,
            decommission.retire_gpuaas_node,
            decommission.enable_node,
            decommission.quarantine_node,
            decommission.release_maas_node,
            decommission.power_off_maas_node,
            decommission.remove_maas_record,
            decommission.begin_remove,
            decommission.finish_remove,
            decommission.cleanup_secrets,
            decommission.observe,
            decommission.compensate,
            decommission.node_status,
            decommission.record_progress,
            decommission.record_node_task,
            reimage.decommission_load_site_config,
            reimage.decommission_configure_storage,
            reimage.decommission_apply_roce_phase2,
            reimage.decommission_ensure_pxe_interface_auto,
            reimage.decommission_render_cloud_init,
            reimage.decommission_deploy_via_maas,
            reimage.decommission_wait_for_deployed,
            reimage.decommission_ensure_hardware_sync_configured,
            reimage.decommission_wait_for_hardware_sync_healthy,
            reimage.decommission_wait_for_agent_enrollment,
            *operation_activities(sessions, secret_store, client),
            *TerminalSessionActivities(sessions, client).activities(),
        ],
        # Workflow activations are short CPU bursts under the GIL: a few threads beat many (a
        # hundred threads mostly trade the GIL back and forth on a 2-core machine).
        workflow_task_executor=ThreadPoolExecutor(max_workers=2),
        max_concurrent_workflow_tasks=100,
        max_concurrent_workflow_task_polls=20,
        # Every POST's workflow task is a new workflow's first, which comes on the shared (not
        # the sticky) queue: as many pollers there as on the sticky queue, not a fifth. Waits
        # between a workflow's start and its first task halved under load.
        nonsticky_to_sticky_poll_ratio=1.0,
        max_concurrent_activities=100,
        max_concurrent_local_activities=100,
    )


async def ensure_schedules(client: Client, settings: Settings) -> None:
    """The control plane's own periodic workflows (sites' reconcilers come with their sites)."""
    queue = settings.control_plane_task_queue
    await ensure_schedule(
        client,
        BILLING_SCHEDULE_ID,
        periodic_schedule(
            BILLING_SCHEDULE_ID,
            BillingMeterWorkflow.run,
            MeterInput(),
            every=timedelta(minutes=1),
            task_queue=queue,
        ),
    )
    await ensure_schedule(
        client,
        LIVENESS_SCHEDULE_ID,
        periodic_schedule(
            LIVENESS_SCHEDULE_ID,
            NodeLivenessWorkflow.run,
            LivenessInput(settings.node_offline_after_seconds),
            every=timedelta(seconds=30),
            task_queue=queue,
        ),
    )


async def run(settings: Settings) -> None:
    client = await connect(settings, identity=process_identity("gpucloud-control-plane"))
    engine = create_engine(
        settings.database_url,
        connect_timeout_seconds=settings.database_connect_timeout_seconds,
        # Sized for the local activities that run at once (placement, transitions): connections
        # beyond pool_size are closed when returned, so steady use above it reconnects each time.
        pool_size=30,
        max_overflow=20,
    )
    worker = build_worker(client, settings, engine)
    await ensure_schedules(client, settings)
    await ensure_stripe_reconciliation_schedule(
        client,
        task_queue=settings.control_plane_task_queue,
        every_seconds=PaymentSettings.from_env().reconciliation_interval_seconds,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with worker:
        logging.info("control-plane worker on task queue %s", settings.control_plane_task_queue)
        await stop.wait()
    await engine.dispose()


def main() -> None:
    enable_crash_traces()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    # The stripe library logs request and error details (an error body may quote the API key).
    logging.getLogger("stripe").setLevel(logging.WARNING)
    tune_for_service()
    uvloop.run(run(Settings.from_env()))


if __name__ == "__main__":
    main()
