"""`NodeHostBackend`: one node's HostBackend made of a slice backend and a bare-metal backend.

Slice calls (provision/release of a VM) go to `slice`, bare-metal calls (a tenant user on the
whole node) go to `baremetal`. A node that serves only one shape leaves the other None; a call for
the missing one is `invalid_spec` ("... not served on this node"), like the single-shape backends
answer it themselves.
"""

from __future__ import annotations

from agent.backend import (
    HostBackend,
    HostError,
    Progress,
    ProvisionOutcome,
    ReleaseOutcome,
    RevokeOutcome,
)
from contracts.host_tasks import HostErrorType, HostProvisionInput, HostReleaseInput


class NodeHostBackend:
    def __init__(
        self, *, slice: HostBackend | None = None, baremetal: HostBackend | None = None
    ) -> None:
        self.slice = slice
        self.baremetal = baremetal

    def _slice(self) -> HostBackend:
        if self.slice is None:
            raise HostError(HostErrorType.INVALID_SPEC, "GPU slices are not served on this node")
        return self.slice

    def _baremetal(self) -> HostBackend:
        if self.baremetal is None:
            raise HostError(
                HostErrorType.INVALID_SPEC, "bare-metal access is not served on this node"
            )
        return self.baremetal

    def provision_slice_vm(self, spec: HostProvisionInput, progress: Progress) -> ProvisionOutcome:
        return self._slice().provision_slice_vm(spec, progress)

    def release_slice_vm(self, spec: HostReleaseInput, progress: Progress) -> ReleaseOutcome:
        return self._slice().release_slice_vm(spec, progress)

    def provision_baremetal_user(
        self, spec: HostProvisionInput, progress: Progress
    ) -> ProvisionOutcome:
        return self._baremetal().provision_baremetal_user(spec, progress)

    def deprovision_baremetal_user(
        self, spec: HostReleaseInput, progress: Progress
    ) -> ReleaseOutcome:
        return self._baremetal().deprovision_baremetal_user(spec, progress)

    def revoke_baremetal_user(self, spec: HostReleaseInput, progress: Progress) -> RevokeOutcome:
        return self._baremetal().revoke_baremetal_user(spec, progress)
