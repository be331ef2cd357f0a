"""One way to build the data converter and connect to Temporal, used by the worker, the agents,
the gateway, the tests and the replayer, so that all of them read each other's payloads."""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

from temporalio.client import Client, WorkflowHistory
from temporalio.converter import (
    DataConverter,
    DefaultFailureConverterWithEncodedAttributes,
    PayloadCodec,
)
from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig
from temporalio.service import GrpcCompression, TLSConfig

from core.codec import AesGcmPayloadCodec, NodePayloadCodec
from core.config import Settings
from core.payload_json import PayloadConverter


def data_converter(
    codec_key: bytes, old_keys: Sequence[bytes] = (), *, node_id: str | None = None
) -> DataConverter:
    """The control plane's converter (the cluster key, and old ones still decoded); with
    `node_id`, a node agent's: `codec_key` is then that node's derived key (core/codec.py)."""
    codec: PayloadCodec = (
        NodePayloadCodec(codec_key, node_id)
        if node_id is not None
        else AesGcmPayloadCodec(codec_key, old_keys)
    )
    # Failure messages and stack traces are encrypted too: an exception may quote an input.
    return dataclasses.replace(
        DataConverter.default,
        payload_converter_class=PayloadConverter,
        payload_codec=codec,
        failure_converter_class=DefaultFailureConverterWithEncodedAttributes,
    )


def with_node_payload_key(client: Client, node_key: bytes, node_id: str) -> Client:
    """`client` (its connection, namespace and identity) with a node agent's converter: it
    encrypts everything with the node's key and decrypts nothing else."""
    config = client.config()
    config["data_converter"] = data_converter(node_key, node_id=node_id)
    return Client(**config)


_runtimes: dict[str, Runtime] = {}


def metrics_runtime(bind_address: str) -> Runtime:
    """A Temporal runtime that serves the SDK's metrics (workflow-task and activity latencies,
    schedule-to-start, poller and slot counts, RPC counts) at http://{bind_address}/metrics.
    One per address and process: the runtime owns the listening socket."""
    if bind_address not in _runtimes:
        _runtimes[bind_address] = Runtime(
            telemetry=TelemetryConfig(
                metrics=PrometheusConfig(bind_address=bind_address, durations_as_seconds=True)
            )
        )
    return _runtimes[bind_address]


def process_identity(component: str) -> str:
    """The identity a process shows Temporal (Temporal Web's "worker identity" on each task):
    the component, the host and the process id, so that with several workers or gateways an
    operator can tell which process ran a task or started a workflow."""
    return f"{component}@{socket.gethostname()}:{os.getpid()}"


async def connect(settings: Settings, *, lazy: bool = False, identity: str | None = None) -> Client:
    runtime = metrics_runtime(settings.metrics_address) if settings.metrics_address else None
    return await Client.connect(
        settings.temporal_address,
        namespace=settings.temporal_namespace,
        data_converter=data_converter(settings.codec_key, settings.codec_old_keys),
        tls=tls_config(settings),
        lazy=lazy,
        identity=identity,
        connect_timeout=timedelta(seconds=5),
        # No gzip on the wire: every payload is AES-GCM ciphertext, which does not compress, so
        # the SDK's default gzip only burned CPU on both ends (about 4 % of the Temporal
        # server's on the allocation path, plus the same again in each client process).
        grpc_compression=GrpcCompression.NONE,
        runtime=runtime,  # a worker polls through its client's runtime, so its metrics are here
    )


def tls_config(settings: Settings) -> TLSConfig | bool:
    """TLS to the Temporal frontend when any TLS file is configured (mTLS with a client
    certificate and key); plaintext otherwise, as the embedded dev server speaks."""
    files = (
        settings.temporal_tls_ca_file,
        settings.temporal_tls_cert_file,
        settings.temporal_tls_key_file,
    )
    if not any(files) and settings.temporal_tls_server_name is None:
        return False
    if bool(settings.temporal_tls_cert_file) != bool(settings.temporal_tls_key_file):
        raise ValueError(
            "GPUCLOUD_TEMPORAL_TLS_CERT_FILE and GPUCLOUD_TEMPORAL_TLS_KEY_FILE go together"
        )
    ca, cert, key = (Path(f).read_bytes() if f else None for f in files)
    return TLSConfig(
        server_root_ca_cert=ca,
        client_cert=cert,
        client_private_key=key,
        domain=settings.temporal_tls_server_name,
    )


async def run_histories(client: Client, workflow_id: str) -> list[WorkflowHistory]:
    """Every run's history of `workflow_id`, first run first, following its continue-as-new
    chain from the first run the latest one names."""
    latest = await client.get_workflow_handle(workflow_id).fetch_history()
    run_id = latest.events[0].workflow_execution_started_event_attributes.first_execution_run_id
    histories: list[WorkflowHistory] = []
    while run_id:
        history = await client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()
        histories.append(history)
        continued = history.events[-1].workflow_execution_continued_as_new_event_attributes
        run_id = continued.new_execution_run_id
    return histories
