"""Links into Temporal Web: one workflow, or the workflow list filtered by our search attributes
(core/search_attributes.py). Temporal Web keeps saved views in the browser, so the console's
"saved view" is a link whose query leaves out the schedules' runs (billing-meter every minute,
node-liveness every 30 s, each site's MAAS reconciler)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import quote, urlencode

from temporalio.common import SearchAttributeKey

from core import search_attributes

# Temporal sets TemporalScheduledById on every run a schedule starts; nothing else has it.
WITHOUT_SCHEDULE_RUNS = "TemporalScheduledById IS NULL"


def attribute_query(attributes: Mapping[SearchAttributeKey[str], str]) -> str:
    """`Name = "value" AND ...` over Keyword search attributes."""
    return " AND ".join(
        f'{key.name} = "{value.replace(chr(92), "").replace(chr(34), "")}"'
        for key, value in attributes.items()
    )


@dataclass(frozen=True)
class TemporalWeb:
    origin: str  # e.g. http://localhost:8233
    namespace: str

    def _namespace_url(self) -> str:
        return f"{self.origin.rstrip('/')}/namespaces/{quote(self.namespace, safe='')}"

    def workflow(self, workflow_id: str) -> str:
        """The workflow's latest run."""
        return f"{self._namespace_url()}/workflows/{quote(workflow_id, safe='')}"

    def workflows(self, query: str) -> str:
        return f"{self._namespace_url()}/workflows?{urlencode({'query': query})}"

    def without_schedule_runs(self) -> str:
        return self.workflows(WITHOUT_SCHEDULE_RUNS)

    def for_node(self, node_id: str) -> str:
        return self.workflows(attribute_query({search_attributes.NODE_ID: node_id}))

    def for_batch(self, batch_id: str) -> str:
        return self.workflows(attribute_query({search_attributes.BATCH_ID: batch_id}))

    def for_site(self, site_id: str, lifecycle_status: str | None = None) -> str:
        attributes = {search_attributes.SITE_ID: site_id}
        if lifecycle_status:
            attributes[search_attributes.LIFECYCLE_STATUS] = lifecycle_status
        return self.workflows(attribute_query(attributes))

    def for_allocation_status(self, status: str) -> str:
        return self.workflows(attribute_query({search_attributes.ALLOCATION_STATUS: status}))
