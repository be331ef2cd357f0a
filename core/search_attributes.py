"""Search attributes the workflows upsert. The dev server registers exactly this list."""

from __future__ import annotations

from temporalio.common import SearchAttributeKey

ALLOCATION_STATUS = SearchAttributeKey.for_keyword("AllocationStatus")
PROJECT_ID = SearchAttributeKey.for_keyword("ProjectId")
NODE_ID = SearchAttributeKey.for_keyword("NodeId")
SKU = SearchAttributeKey.for_keyword("Sku")

ALL = (ALLOCATION_STATUS, PROJECT_ID, NODE_ID, SKU)


def dev_server_flags() -> list[str]:
    """`--search-attribute Name=Keyword` flags for `temporal server start-dev`."""
    flags: list[str] = []
    for key in ALL:
        flags += ["--search-attribute", f"{key.name}=Keyword"]
    return flags
