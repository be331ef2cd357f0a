"""Checks a host task's spec before any host work starts; a bad spec is `invalid_spec`, never
retried. Messages name fields and positions only, never values that could be secret (keys)."""

from __future__ import annotations

import re

from contracts.host_tasks import (
    SHAPE_BAREMETAL,
    SHAPE_GPU_SLICE,
    HostProvisionInput,
    HostReleaseInput,
)

# POSIX-portable user names, as useradd accepts them by default.
_USERNAME = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
_PCI_ADDRESS = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


class InvalidSpec(ValueError):
    pass


def _check_common(
    allocation_id: str,
    node_id: str,
    shape: str,
    expected_shape: str,
    agent_node_id: str | None,
) -> None:
    if not allocation_id:
        raise InvalidSpec("allocation_id is empty")
    if shape != expected_shape:
        raise InvalidSpec(f"shape {shape!r} does not match this task (expected {expected_shape})")
    if agent_node_id is not None and node_id != agent_node_id:
        # The task reached the wrong node's queue: doing it here would touch the wrong host.
        raise InvalidSpec(f"task is for node {node_id}, this agent serves {agent_node_id}")


def _check_username(username: str) -> None:
    if not _USERNAME.match(username):
        raise InvalidSpec("username is not a valid POSIX user name")


def _check_ssh_keys(keys: list[str]) -> None:
    for index, key in enumerate(keys):
        # A newline would smuggle extra lines into authorized_keys; say where, not what.
        if not key.strip() or "\n" in key or "\r" in key:
            raise InvalidSpec(f"ssh_public_keys[{index}] is not a single-line public key")


def validate_slice_provision(spec: HostProvisionInput, agent_node_id: str | None) -> None:
    _check_common(spec.allocation_id, spec.node_id, spec.shape, SHAPE_GPU_SLICE, agent_node_id)
    if not spec.gpus:
        raise InvalidSpec("a GPU slice needs at least one GPU")
    addresses = [gpu.pci_address.lower() for gpu in spec.gpus]
    for address in addresses:
        if not _PCI_ADDRESS.match(address):
            raise InvalidSpec(f"GPU PCI address {address!r} is not of the form 0000:17:00.0")
    if len(set(addresses)) != len(addresses):
        raise InvalidSpec("the same GPU is listed twice")
    if spec.vcpus < 0 or spec.memory_mb < 0:
        raise InvalidSpec("vcpus and memory_mb must not be negative")
    _check_ssh_keys(spec.ssh_public_keys)


def validate_baremetal_provision(spec: HostProvisionInput, agent_node_id: str | None) -> None:
    _check_common(spec.allocation_id, spec.node_id, spec.shape, SHAPE_BAREMETAL, agent_node_id)
    _check_username(spec.username)
    _check_ssh_keys(spec.ssh_public_keys)


def validate_slice_release(spec: HostReleaseInput, agent_node_id: str | None) -> None:
    _check_common(spec.allocation_id, spec.node_id, spec.shape, SHAPE_GPU_SLICE, agent_node_id)


def validate_baremetal_release(spec: HostReleaseInput, agent_node_id: str | None) -> None:
    _check_common(spec.allocation_id, spec.node_id, spec.shape, SHAPE_BAREMETAL, agent_node_id)
    _check_username(spec.username)
