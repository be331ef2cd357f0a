"""MAAS's own vocabulary: node statuses with their numbers and labels, power states, event types
with their levels, script-result statuses. Values are the ones the real region uses
(maascommon/node.py NODE_STATUS_LABELS, maascommon/events.py EVENT_DETAILS_MAP)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import IntEnum


class NodeStatus(IntEnum):
    NEW = 0
    COMMISSIONING = 1
    FAILED_COMMISSIONING = 2
    MISSING = 3
    READY = 4
    RESERVED = 5
    DEPLOYED = 6
    RETIRED = 7
    BROKEN = 8
    DEPLOYING = 9
    ALLOCATED = 10
    FAILED_DEPLOYMENT = 11
    RELEASING = 12
    FAILED_RELEASING = 13
    DISK_ERASING = 14
    FAILED_DISK_ERASING = 15
    RESCUE_MODE = 16
    ENTERING_RESCUE_MODE = 17
    FAILED_ENTERING_RESCUE_MODE = 18
    EXITING_RESCUE_MODE = 19
    FAILED_EXITING_RESCUE_MODE = 20
    TESTING = 21
    FAILED_TESTING = 22

    @property
    def label(self) -> str:
        return _STATUS_LABELS[self]

    @classmethod
    def parse(cls, text: str) -> NodeStatus:
        """A label ("Failed deployment"), an enum name ("failed_deployment") or a number."""
        key = text.strip()
        if key.isdigit():
            return cls(int(key))
        for status in cls:
            if key.lower() in (status.label.lower(), status.name.lower()):
                return status
        raise ValueError(f"unknown MAAS status {text!r}")


_STATUS_LABELS: dict[NodeStatus, str] = {
    NodeStatus.NEW: "New",
    NodeStatus.COMMISSIONING: "Commissioning",
    NodeStatus.FAILED_COMMISSIONING: "Failed commissioning",
    NodeStatus.MISSING: "Missing",
    NodeStatus.READY: "Ready",
    NodeStatus.RESERVED: "Reserved",
    NodeStatus.DEPLOYED: "Deployed",
    NodeStatus.RETIRED: "Retired",
    NodeStatus.BROKEN: "Broken",
    NodeStatus.DEPLOYING: "Deploying",
    NodeStatus.ALLOCATED: "Allocated",
    NodeStatus.FAILED_DEPLOYMENT: "Failed deployment",
    NodeStatus.RELEASING: "Releasing",
    NodeStatus.FAILED_RELEASING: "Releasing failed",
    NodeStatus.DISK_ERASING: "Disk erasing",
    NodeStatus.FAILED_DISK_ERASING: "Failed disk erasing",
    NodeStatus.RESCUE_MODE: "Rescue mode",
    NodeStatus.ENTERING_RESCUE_MODE: "Entering rescue mode",
    NodeStatus.FAILED_ENTERING_RESCUE_MODE: "Failed to enter rescue mode",
    NodeStatus.EXITING_RESCUE_MODE: "Exiting rescue mode",
    NodeStatus.FAILED_EXITING_RESCUE_MODE: "Failed to exit rescue mode",
    NodeStatus.TESTING: "Testing",
    NodeStatus.FAILED_TESTING: "Failed testing",
}

# What op=release accepts (anything else but Ready/Releasing is a 409).
RELEASABLE = frozenset(
    {
        NodeStatus.ALLOCATED,
        NodeStatus.RESERVED,
        NodeStatus.BROKEN,
        NodeStatus.DEPLOYING,
        NodeStatus.DEPLOYED,
        NodeStatus.FAILED_DEPLOYMENT,
        NodeStatus.FAILED_DISK_ERASING,
        NodeStatus.FAILED_RELEASING,
    }
)
COMMISSIONABLE = frozenset(
    {NodeStatus.NEW, NodeStatus.FAILED_COMMISSIONING, NodeStatus.READY, NodeStatus.BROKEN}
)
# op=link_subnet / unlink_subnet edit interfaces only in these.
INTERFACE_EDITABLE = frozenset(
    {
        NodeStatus.NEW,
        NodeStatus.READY,
        NodeStatus.FAILED_TESTING,
        NodeStatus.ALLOCATED,
        NodeStatus.BROKEN,
    }
)


class PowerState:
    ON = "on"
    OFF = "off"
    UNKNOWN = "unknown"
    ERROR = "error"


AUDIT = 0
LEVEL_NAMES: dict[int, str] = {
    AUDIT: "AUDIT",
    logging.DEBUG: "DEBUG",
    logging.INFO: "INFO",
    logging.WARNING: "WARNING",
    logging.ERROR: "ERROR",
    logging.CRITICAL: "CRITICAL",
}
LEVELS_BY_NAME: dict[str, int] = {name: level for level, name in LEVEL_NAMES.items()}


@dataclass(frozen=True)
class EventType:
    description: str  # what the API shows as the event's "type"
    level: int


def _t(description: str, level: int) -> EventType:
    return EventType(description, level)


class Ev:
    """The event types the simulator writes, as the region names and levels them."""

    POWERED_ON = _t("Node powered on", logging.DEBUG)
    POWERED_OFF = _t("Node powered off", logging.DEBUG)
    POWER_ON_FAILED = _t("Failed to power on node", logging.ERROR)
    POWER_OFF_FAILED = _t("Failed to power off node", logging.ERROR)
    POWER_QUERY_FAILED = _t("Failed to query node's BMC", logging.WARNING)
    CHANGED_STATUS = _t("Node changed status", logging.DEBUG)
    INSTALLATION_FINISHED = _t("Installation complete", logging.DEBUG)
    DISKS_ERASED = _t("Disks erased", logging.INFO)
    COMMISSIONING_EVENT = _t("Node commissioning", logging.DEBUG)
    COMMISSIONING_EVENT_FAILED = _t("Node commissioning failure", logging.ERROR)
    INSTALL_EVENT = _t("Node installation", logging.DEBUG)
    INSTALL_EVENT_FAILED = _t("Node installation failure", logging.ERROR)
    START_COMMISSIONING = _t("User starting node commissioning", logging.DEBUG)
    ABORT_COMMISSIONING = _t("User aborting node commissioning", logging.DEBUG)
    ABORT_TESTING = _t("User aborting node testing", logging.DEBUG)
    ABORT_DEPLOYMENT = _t("User aborting deployment", logging.DEBUG)
    ACQUIRE = _t("User acquiring node", logging.DEBUG)
    ERASE_DISK = _t("User erasing disk", logging.DEBUG)
    ABORT_ERASE_DISK = _t("User aborting disk erase", logging.DEBUG)
    RELEASE = _t("User releasing node", logging.DEBUG)
    MARK_FAILED_SYSTEM = _t("Marking node failed", logging.ERROR)
    MARK_BROKEN = _t("User marking node broken", logging.DEBUG)
    MARK_BROKEN_SYSTEM = _t("Marking node broken", logging.ERROR)
    MARK_FIXED = _t("User marking node fixed", logging.DEBUG)
    START_DEPLOYMENT = _t("User starting deployment", logging.DEBUG)
    START = _t("User powering up node", logging.DEBUG)
    STOP = _t("User powering down node", logging.DEBUG)
    HARDWARE_SYNC_BMC = _t("Node BMC hardware sync state change", logging.INFO)
    CONFIGURING_STORAGE = _t("Configuring storage", logging.INFO)
    INSTALLING_OS = _t("Installing OS", logging.INFO)
    CONFIGURING_OS = _t("Configuring OS", logging.INFO)
    REBOOTING = _t("Rebooting", logging.INFO)
    PERFORMING_PXE_BOOT = _t("Performing PXE boot", logging.INFO)
    LOADING_EPHEMERAL = _t("Loading ephemeral", logging.INFO)
    GATHERING_INFO = _t("Gathering information", logging.INFO)
    RUNNING_TEST = _t("Running test", logging.INFO)
    NEW = _t("New", logging.INFO)
    COMMISSIONING = _t("Commissioning", logging.INFO)
    TESTING = _t("Testing", logging.INFO)
    READY = _t("Ready", logging.INFO)
    DEPLOYING = _t("Deploying", logging.INFO)
    DEPLOYED = _t("Deployed", logging.INFO)
    RELEASING = _t("Releasing", logging.INFO)
    RELEASED = _t("Released", logging.INFO)
    ABORTED_DISK_ERASING = _t("Aborted disk erasing", logging.INFO)
    ABORTED_COMMISSIONING = _t("Aborted commissioning", logging.INFO)
    ABORTED_DEPLOYMENT = _t("Aborted deployment", logging.INFO)
    ABORTED_TESTING = _t("Aborted testing", logging.INFO)


class ScriptStatus(IntEnum):
    """commissioning_status / testing_status of a machine (metadataserver SCRIPT_STATUS)."""

    NONE = -1
    PENDING = 0
    RUNNING = 1
    PASSED = 2
    FAILED = 3
    TIMEDOUT = 4
    ABORTED = 5

    @property
    def label(self) -> str:
        return {
            ScriptStatus.NONE: "None",
            ScriptStatus.PENDING: "Pending",
            ScriptStatus.RUNNING: "Running",
            ScriptStatus.PASSED: "Passed",
            ScriptStatus.FAILED: "Failed",
            ScriptStatus.TIMEDOUT: "Timed out",
            ScriptStatus.ABORTED: "Aborted",
        }[self]
