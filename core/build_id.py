"""The build id the control-plane worker reports to Temporal, and the `BuildIds` a workflow the
gateway starts carries from its start.

Temporal records, at a workflow's first workflow task, the build id of the worker that
completed it in the predefined `BuildIds` search attribute (`unversioned` and
`unversioned:<build id>` for a worker without versioning), and every change to a search
attribute is one more visibility write: on the dev server, a row rewritten on its one SQLite
connection, at every allocation's POST. A workflow that starts with exactly that value has
nothing left to record. Both ends must agree on the id, so it is not the SDK's default (a
checksum of whatever modules the worker process has loaded) but a checksum of the workflow
code, which the gateway and the worker read from the same tree; a release may name itself
instead (GPUCLOUD_BUILD_ID). Should the two ever differ (a rolling upgrade), Temporal simply
adds the worker's id, as it would have anyway.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from pathlib import Path

from temporalio.common import SearchAttributeKey, SearchAttributePair

BUILD_IDS = SearchAttributeKey.for_keyword_list("BuildIds")
# What the server records first for a worker that does not use worker versioning.
UNVERSIONED = "unversioned"
_WORKFLOW_CODE = Path(__file__).resolve().parent.parent / "workflows"


@functools.cache
def workflow_code_build_id() -> str:
    """`wf-` and a checksum of the workflow package's sources: it changes with the code that
    runs workflow tasks, and nothing else."""
    digest = hashlib.sha256()
    for path in sorted(_WORKFLOW_CODE.rglob("*.py")):
        digest.update(path.relative_to(_WORKFLOW_CODE).as_posix().encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return f"wf-{digest.hexdigest()[:20]}"


def build_ids_at_start(build_id: str) -> SearchAttributePair[Sequence[str]]:
    """The `BuildIds` a worker reporting `build_id` would leave after its first workflow task."""
    return SearchAttributePair(BUILD_IDS, [UNVERSIONED, f"{UNVERSIONED}:{build_id}"])
