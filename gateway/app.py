"""The Litestar application factory.

The app starts even when PostgreSQL or Temporal are down: the engine connects on first use and
the Temporal client is lazy. Requests that need them then answer 503 `database_unavailable` or
`temporal_unavailable` promptly.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from litestar import Litestar
from litestar.config.cors import CORSConfig
from litestar.di import Provide
from temporalio.client import Client

from core.config import Settings
from core.secrets import SecretStore, VaultSecretStore
from core.temporal import connect, process_identity
from gateway.auth import provide_principal
from gateway.config import GatewayConfig
from gateway.console import console_router, console_template_config
from gateway.controllers.admin import (
    AdminAllocationsController,
    AdminAuditController,
    AdminProjectsController,
    AdminTokensController,
)
from gateway.controllers.allocation_groups import (
    AdminAllocationGroupsController,
    AllocationGroupsController,
)
from gateway.controllers.allocations import AllocationsController
from gateway.controllers.billing import AdminBillingController, BillingController
from gateway.controllers.codec import CodecController
from gateway.controllers.decommissions import AdminDecommissionsController
from gateway.controllers.enrollment import (
    AdminNodeEnrollmentController,
    AgentEnrollmentController,
)
from gateway.controllers.gpu_slots import AdminGpuSlotsController
from gateway.controllers.health import HealthController
from gateway.controllers.maas_sites import AdminMaasSitesController
from gateway.controllers.nodes import AdminNodesController
from gateway.controllers.notifications import NotificationsController
from gateway.controllers.onboardings import AdminOnboardingsController
from gateway.controllers.payments import (
    AdminPaymentsController,
    PaymentsController,
    StripeWebhookController,
)
from gateway.controllers.reconciliation import AdminReconciliationController
from gateway.controllers.ssh_keys import SshKeysController
from gateway.controllers.storage import (
    AdminStorageController,
    AllocationAttachmentsController,
    StorageNamespacesController,
)
from gateway.controllers.terminal_sessions import (
    AdminTerminalSessionsController,
    TerminalSessionsController,
)
from gateway.errors import exception_handler
from gateway.openapi import openapi_config, swagger_ui_asset
from gateway.request_decoding import StrictRequest, check_parameters
from gateway.runtime import (
    STATE_KEY,
    Runtime,
    provide_db,
    provide_runtime,
    provide_secrets,
    provide_temporal,
)
from gateway.temporal import TemporalOps
from gateway.terminal_relay import node_stream, tenant_stream
from schema.db import create_engine, session_factory

log = logging.getLogger("gateway")

API_VERSION = "1.0.0"


def _cors(config: GatewayConfig) -> CORSConfig:
    """Temporal Web (another origin) calls the codec endpoint with credentials: allow exactly its
    origin, the headers it sends, and cookies."""
    return CORSConfig(
        allow_origins=[config.temporal_ui_origin],
        allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
        allow_headers=["authorization", "content-type", "x-namespace"],
        allow_credentials=True,
        max_age=600,
    )


def create_app(
    settings: Settings,
    *,
    temporal_client: Client | None = None,
    config: GatewayConfig | None = None,
    secret_store: SecretStore | None = None,
) -> Litestar:
    gateway_config = config or GatewayConfig.from_env()

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        engine = create_engine(
            settings.database_url,
            connect_timeout_seconds=settings.database_connect_timeout_seconds,
            # Requests in flight at once each hold a connection for a moment; beyond pool_size
            # a returned connection is closed, so a steady load above it reconnects every time.
            pool_size=20,
            max_overflow=10,
        )
        client = temporal_client
        if client is None:
            try:
                client = await connect(
                    settings, lazy=True, identity=process_identity("gpucloud-gateway")
                )
            except Exception as err:  # an unusable address: serve 503s, do not refuse to start
                log.warning("Temporal client not created (%s); answering 503", type(err).__name__)
                client = None
        app.state[STATE_KEY] = Runtime(
            settings=settings,
            config=gateway_config,
            engine=engine,
            sessions=session_factory(engine),
            temporal=TemporalOps(client, settings),
            secrets=secret_store or VaultSecretStore.from_settings(settings),
        )
        try:
            yield
        finally:
            await engine.dispose()

    return Litestar(
        route_handlers=[
            HealthController,
            AdminProjectsController,
            AdminTokensController,
            AdminAuditController,
            AdminAllocationsController,
            SshKeysController,
            AllocationsController,
            AllocationGroupsController,
            AdminAllocationGroupsController,
            CodecController,
            AdminMaasSitesController,
            AdminOnboardingsController,
            AdminDecommissionsController,
            AdminNodeEnrollmentController,
            AgentEnrollmentController,
            AdminGpuSlotsController,
            AdminNodesController,
            BillingController,
            AdminBillingController,
            PaymentsController,
            StripeWebhookController,
            AdminPaymentsController,
            AdminReconciliationController,
            NotificationsController,
            TerminalSessionsController,
            AdminTerminalSessionsController,
            tenant_stream,
            node_stream,
            StorageNamespacesController,
            AllocationAttachmentsController,
            AdminStorageController,
            console_router(),
            swagger_ui_asset,
        ],
        dependencies={
            "db": Provide(provide_db),
            "runtime": Provide(provide_runtime),
            "temporal": Provide(provide_temporal),
            "principal": Provide(provide_principal),
            "secrets": Provide(provide_secrets),
        },
        exception_handlers={Exception: exception_handler},
        # JSON bodies decode strictly, bounded in depth, with no control character in any
        # string, before a handler runs (gateway.request_decoding).
        request_class=StrictRequest,
        # Query, path and header parameters as strictly, after the guards, before the handler.
        before_request=check_parameters,
        lifespan=[lifespan],
        request_max_body_size=settings.max_request_body_bytes,
        cors_config=_cors(gateway_config),
        # The operator console's pages (gateway/console/).
        template_config=console_template_config(),
        openapi_config=openapi_config(title="gpucloud control plane API", version=API_VERSION),
        # The process configures logging (gateway.serve); building an app must not. Litestar's
        # default replaced the root logger's handlers with its own queue listener: every
        # record, the access log's included, then cost a hand-off to a second thread, and an
        # app built inside a test dropped pytest's capture handler, so the tests' "no secret
        # in the logs" checks saw no logs at all.
        logging_config=None,
        debug=False,
    )
