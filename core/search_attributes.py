"""Search attributes the workflows upsert. The dev server registers exactly this list."""

from __future__ import annotations

from temporalio.common import SearchAttributeKey

ALLOCATION_STATUS = SearchAttributeKey.for_keyword("AllocationStatus")
PROJECT_ID = SearchAttributeKey.for_keyword("ProjectId")
NODE_ID = SearchAttributeKey.for_keyword("NodeId")
SKU = SearchAttributeKey.for_keyword("Sku")
# Node lifecycle jobs (onboarding, decommission): find a stuck node in one Temporal Web query,
# e.g. `SiteId = "..." AND LifecycleStatus = "failed_manual_intervention"`.
SITE_ID = SearchAttributeKey.for_keyword("SiteId")
HOSTNAME = SearchAttributeKey.for_keyword("Hostname")
LIFECYCLE_STATUS = SearchAttributeKey.for_keyword("LifecycleStatus")
CURRENT_STAGE = SearchAttributeKey.for_keyword("CurrentStage")
BATCH_ID = SearchAttributeKey.for_keyword("BatchId")

ALL = (
    ALLOCATION_STATUS,
    PROJECT_ID,
    NODE_ID,
    SKU,
    SITE_ID,
    HOSTNAME,
    LIFECYCLE_STATUS,
    CURRENT_STAGE,
    BATCH_ID,
)


def dev_server_flags() -> list[str]:
    """`--search-attribute Name=Keyword` flags for `temporal server start-dev`."""
    flags: list[str] = []
    for key in ALL:
        flags += ["--search-attribute", f"{key.name}=Keyword"]
    return flags
