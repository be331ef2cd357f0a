"""The ledger property suite (issue 37, "Tests and checks"): Hypothesis draws sequences of what
a tenant (and an admin, and the meter) can do to one project's money, on the real stack with a
one-second billing window, and after every step the ledger must agree with what the test saw
from outside (tests/ledger_model_support.py):

- the running balance is the ledger's sum (check_running_totals), the tenant's balance reads it,
  and `depleted` is exactly "the sum is not above 0";
- each usage record's debits are GPUs x price over its billed span, rounded down once (so within
  one window's rounding of the exact usage), and the meter leaves no more than one window of
  usage unbilled; the same for each namespace's quota x GB-hour price;
- usage starts between the POST and the first sight of the allocation active, and ends between
  the release request (user, admin force-release, or the meter's depletion release) and the
  first sight of it `released` or `release_failed`: no debit after the tenant was fenced, no
  usable time left unbilled; a namespace is billed from its creation to its deletion;
- every credit is one payment, for exactly what Stripe (stripe-mock, through a signed webhook)
  reported paid, in the account's currency; a checkout in another currency is refused
  `currency_mismatch` and creates nothing;
- two meter runs at once post each window once, and a repeated run (same `until`) posts
  nothing.

The stack: nodes made by onboarding (tests/enrolled_fleet.py: one slice node, one bare-metal
node), the production worker with its Stripe client on stripe-mock and its BillingActivities on
a one-second window (the one seam: `worker.BillingActivities`), the gateway over ASGI, the
meter run through BillingMeterWorkflow with `until` at (or just before) the wall clock, so what
the meter bills is time that really passed.

Steps are data (a list per example, replayable as a named regression test); the model runs in a
thread and sends each step's coroutine to the test's event loop, as tests/test_safety_model.py
does. Each example is a fresh project (rich, or poor enough that a bare-metal allocation spends
it in seconds); at its end everything is released and metered and checked once more.

CI runs a fixed seed (derandomize) with a small budget; GPUCLOUD_LEDGER_EXAMPLES and
GPUCLOUD_LEDGER_STEPS run it longer, GPUCLOUD_LEDGER_SHRINK=1 lets Hypothesis shrink a failure."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import functools
import json
import os
import uuid
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from temporalio.client import Client

import worker as worker_module
from activities.billing.metering import BillingActivities
from contracts.billing_meter import MeterInput, MeterResult
from contracts.host_tasks import SLICE_VM_RELEASE, HostErrorType
from core.payment_settings import STRIPE_API_KEY_PATH, STRIPE_WEBHOOK_SECRET_PATH
from tests.enrolled_fleet import EnrolledFleet, EnrolledNode
from tests.factories import STARTING_CREDIT_MINOR
from tests.gateway_fixtures import ed25519_public_key
from tests.ledger_model_support import (
    AllocationSeen,
    LedgerModel,
    NamespaceSeen,
    check_ledger,
    now,
    read_ledger,
)
from tests.lifecycle_support import LoopBridge, baremetal_request, eventually, slice_request
from tests.stripe_fixtures import StripeMock, checkout_event, sign
from workflows.billing_meter import BillingMeterWorkflow

EXAMPLES = int(os.environ.get("GPUCLOUD_LEDGER_EXAMPLES", "10"))
STEPS = int(os.environ.get("GPUCLOUD_LEDGER_STEPS", "6"))
WINDOW_SECONDS = 1
PRICE = 250  # minor units per GPU-hour, tests/factories.create_sku
POOR_CREDIT = 5  # a bare-metal allocation (8 GPUs, 2000/h) spends it in 9 s
GB = 10**9
QUOTA_LIMIT = 10 << 40  # schema.models.DEFAULT_STORAGE_QUOTA_LIMIT_BYTES
STEP_TIMEOUT_S = 180.0
SETTLE_S = 60.0

pytestmark = pytest.mark.usefixtures("one_second_window")


@pytest.fixture(autouse=True)
def one_second_window(monkeypatch: pytest.MonkeyPatch, stripe_mock: StripeMock) -> None:
    """Before the onboarding rig builds its worker: the meter's window is one second, and the
    worker's Stripe client talks to stripe-mock (secrets in the Vault simulator)."""
    monkeypatch.setattr(
        worker_module,
        "BillingActivities",
        functools.partial(BillingActivities, window_seconds=WINDOW_SECONDS),
    )
    monkeypatch.setenv("GPUCLOUD_STRIPE_API_BASE", stripe_mock.api_base)


@dataclasses.dataclass
class LedgerRig:
    fleet: EnrolledFleet
    slice_node: EnrolledNode
    baremetal_node: EnrolledNode
    admin: httpx.AsyncClient
    api: Any
    make_project: Any
    make_token: Any
    app_settings: Any
    webhook_secret: str
    temporal: Client
    db_sessions: Any


@pytest.fixture
async def ledger_rig(
    enrolled_fleet: EnrolledFleet, secret_store: Any, vault_server: Any, api: Any,
    make_project: Any, make_token: Any, settings: Any, temporal_client: Client, db_sessions: Any,
) -> LedgerRig:  # fmt: skip
    webhook_secret = "whsec_" + uuid.uuid4().hex
    await secret_store.write(STRIPE_API_KEY_PATH, {"key": "sk_test_" + uuid.uuid4().hex[:24]})
    await secret_store.write(STRIPE_WEBHOOK_SECRET_PATH, {"secret": webhook_secret})
    slice_node, baremetal_node = await enrolled_fleet.create(slice_nodes=1, baremetal_nodes=1)
    app_settings = dataclasses.replace(
        settings, vault_addr=vault_server.addr, vault_token=vault_server.token
    )
    return LedgerRig(
        fleet=enrolled_fleet,
        slice_node=slice_node,
        baremetal_node=baremetal_node,
        admin=await api(token=await make_token("admin")),
        api=api,
        make_project=make_project,
        make_token=make_token,
        app_settings=app_settings,
        webhook_secret=webhook_secret,
        temporal=temporal_client,
        db_sessions=db_sessions,
    )


# One step, as data. Allocation and namespace choices are indices taken modulo what exists when
# the step runs. The first alternative is what Hypothesis' simplest example repeats.
STEP = st.one_of(
    st.tuples(st.just("meter"), st.sampled_from([0, 400, 1500])),  # `until` this many ms ago
    st.tuples(st.just("allocate_slice"), st.sampled_from([1, 2, 4])),
    st.tuples(st.just("allocate_baremetal")),
    st.tuples(st.just("release"), st.integers(0, 3)),
    st.tuples(st.just("release_failing"), st.integers(0, 3)),
    st.tuples(st.just("force_release"), st.integers(0, 3)),
    st.tuples(st.just("namespace"), st.sampled_from([GB, 500 * GB, 4 << 40])),
    st.tuples(st.just("delete_namespace"), st.integers(0, 3)),
    st.tuples(st.just("credit"), st.sampled_from([50, 777, 5000])),
    st.tuples(st.just("credit_foreign"), st.sampled_from(["eur", "jpy", "gbp"])),
    st.tuples(st.just("wait"), st.sampled_from([1, 3])),
)


class LedgerWorld:
    """One example: a fresh project and its tenant; `run` plays steps on the event loop, each
    followed by the ledger check."""

    def __init__(self, rig: LedgerRig, credit: int) -> None:
        self.rig = rig
        self.credit = credit
        self.model: LedgerModel | None = None
        self.tenant: httpx.AsyncClient | None = None
        self.ssh_key_id = ""

    @property
    def m(self) -> LedgerModel:
        assert self.model is not None
        return self.model

    @property
    def t(self) -> httpx.AsyncClient:
        assert self.tenant is not None
        return self.tenant

    async def start(self) -> None:
        project = await self.rig.make_project(credit_minor=self.credit)
        self.tenant = await self.rig.api(
            token=await self.rig.make_token("tenant", project), settings=self.rig.app_settings
        )
        key = await self.t.post(
            "/api/v1/ssh-keys", json={"name": "k", "public_key": ed25519_public_key("t@ledger")}
        )
        assert key.status_code == 201, key.text
        self.ssh_key_id = key.json()["id"]
        self.model = LedgerModel(
            project_id=project.id,
            currency="usd",
            price_per_gpu_hour_minor=PRICE,
            window=dt.timedelta(seconds=WINDOW_SECONDS),
            starting_credit_minor=self.credit,
        )
        self.m.log.append(f"example: project {project.id}, credit {self.credit}")
        await self.check("start")

    async def check(self, step: str) -> None:
        ledger = await read_ledger(self.rig.db_sessions, self.m.project_id)
        balance = (await self.t.get("/api/v1/billing/balance")).json()
        try:
            check_ledger(self.m, ledger, balance)
        except AssertionError:
            self.m.log.append(f"  invariant broken after {step}")
            raise

    async def step(self, step: tuple[Any, ...]) -> None:
        outcome = await getattr(self, f"_{step[0]}")(*step[1:])
        self.m.log.append(f"  {step!r}: {outcome}")
        await self.check(repr(step))

    async def finish(self) -> None:
        """Release what is left, meter to now, check once more."""
        for seen in self.m.live():
            await self._release_one(seen, "user")
        await self._meter(0)
        self.m.log.append("  finish")
        await self.check("finish")

    # --- steps ---

    async def _depleted(self) -> bool:
        return bool((await self.t.get("/api/v1/billing/balance")).json()["state"] == "depleted")

    async def _meter(self, ms_ago: int) -> str:
        until = now() - dt.timedelta(milliseconds=ms_ago)
        asked = now()
        # Two runs at once (an overlapping schedule run), then the same run again (a retry):
        # each window posted once in all, the ledger's exact sums tell.
        both = await asyncio.gather(meter(self.rig, until), meter(self.rig, until))
        again = await meter(self.rig, until)
        assert (again.debits_posted, again.charged_minor, again.storage_debits_posted) == (
            0,
            0,
            0,
        ), (
            "a repeated meter run posted again",
            again,
        )
        if self.m.metered_until is None or until > self.m.metered_until:
            self.m.metered_until = until
        released = []
        to_release = sorted({a for run in both for a in run.allocations_to_release})
        for allocation_id in to_release:
            seen = self.m.allocations.get(allocation_id)
            assert seen is not None, f"the meter released another project's {allocation_id}"
            if seen.release_asked_at is None:
                seen.release_asked_at, seen.released_by = asked, "billing"
            await self._settle(seen)
            released.append(seen.id[:8])
        charged = sum(run.charged_minor for run in both)
        posted = sum(run.debits_posted for run in both)
        changes = [c for run in both for c in run.state_changes]
        return f"charged {charged} ({posted} debits), {changes}, released {released}"

    def _free_slice_gpus(self) -> int:
        return 8 - sum(a.gpus for a in self.m.live() if a.shape == "slice")

    async def _allocate(self, shape: str, body: dict[str, Any], gpus: int) -> str:
        depleted = await self._depleted()
        if not depleted:
            if shape == "slice" and self._free_slice_gpus() < gpus:
                return "skipped: no slice capacity"
            if shape == "baremetal" and any(a.shape == "baremetal" for a in self.m.live()):
                return "skipped: bare-metal node held"
        posted_at = now()
        response = await self.t.post("/api/v1/allocations", json=body)
        if depleted:
            assert response.status_code == 402, response.text
            assert response.json()["error"]["code"] == "balance_depleted"
            return "refused 402 (depleted)"
        assert response.status_code == 201, response.text
        allocation_id = response.json()["allocation_id"]
        status = await self._wait_status(allocation_id, {"active"})
        seen = AllocationSeen(allocation_id, shape, gpus, posted_at, now())
        assert status == "active"
        self.m.allocations[allocation_id] = seen
        return f"{allocation_id[:8]} active"

    async def _allocate_slice(self, gpus: int) -> str:
        return await self._allocate("slice", slice_request(gpus, self.ssh_key_id), gpus)

    async def _allocate_baremetal(self) -> str:
        return await self._allocate("baremetal", baremetal_request(self.ssh_key_id), 8)

    def _pick(
        self, i: int, *, slice_only: bool = False, failed_ok: bool = True
    ) -> AllocationSeen | None:
        live = [
            a
            for a in self.m.live()
            if (not slice_only or a.shape == "slice") and (failed_ok or a.status == "active")
        ]
        return live[i % len(live)] if live else None

    async def _release(self, i: int) -> str:
        seen = self._pick(i)
        if seen is None:
            return "skipped: nothing to release"
        was = seen.status
        await self._release_one(seen, "user")
        return f"{seen.id[:8]} {was} -> {seen.status}"

    async def _release_one(self, seen: AllocationSeen, by: str) -> None:
        if seen.release_asked_at is None:
            seen.release_asked_at, seen.released_by = now(), by
        if by == "admin":
            response = await self.rig.admin.post(
                f"/api/v1/admin/allocations/{seen.id}/force-release",
                json={"reason": "ledger property suite"},
            )
        else:
            response = await self.t.post(f"/api/v1/allocations/{seen.id}/release")
        assert response.status_code in (200, 202), response.text
        await self._settle(seen, {"released"})

    async def _release_failing(self, i: int) -> str:
        """The host refuses to stop the VM on every attempt: the release ends release_failed,
        billing closed by then; a later release step retries it."""
        seen = self._pick(i, slice_only=True, failed_ok=False)
        if seen is None:
            return "skipped: no active slice"
        host = self.rig.slice_node.agent.host
        host.faults.inject(SLICE_VM_RELEASE, HostErrorType.RELEASE_ERROR, times=3)
        seen.release_asked_at, seen.released_by = now(), "user"
        response = await self.t.post(f"/api/v1/allocations/{seen.id}/release")
        assert response.status_code in (200, 202), response.text
        await self._settle(seen, {"release_failed"})
        return f"{seen.id[:8]} -> {seen.status}"

    async def _force_release(self, i: int) -> str:
        seen = self._pick(i)
        if seen is None:
            return "skipped: nothing to release"
        was = seen.status
        await self._release_one(seen, "admin")
        return f"{seen.id[:8]} {was} -> {seen.status} (admin)"

    async def _settle(self, seen: AllocationSeen, wanted: set[str] | None = None) -> None:
        status = await self._wait_status(seen.id, wanted or {"released", "release_failed"})
        seen.status = status
        if seen.ended_seen_at is None:
            seen.ended_seen_at = now()

    async def _wait_status(self, allocation_id: str, wanted: set[str]) -> str:
        async def reached() -> str | None:
            body = (await self.t.get(f"/api/v1/allocations/{allocation_id}")).json()
            if body.get("status") in ("failed",) and "failed" not in wanted:
                raise AssertionError(f"allocation failed: {body}")
            return str(body["status"]) if body.get("status") in wanted else None

        return await eventually(reached, timeout=SETTLE_S, interval=0.1)

    async def _namespace(self, quota: int) -> str:
        depleted = await self._depleted()
        total = sum(n.quota_bytes for n in self.m.namespaces_live())
        posted_at = now()
        response = await self.t.post(
            "/api/v1/storage/namespaces",
            json={"name": f"ns-{len(self.m.namespaces)}", "quota_bytes": quota},
        )
        if depleted:
            assert response.status_code == 402, response.text
            return "refused 402 (depleted)"
        if total + quota > QUOTA_LIMIT:
            assert response.status_code == 403, response.text
            assert response.json()["error"]["code"] == "quota_exceeded"
            return "refused 403 (quota)"
        assert response.status_code == 201, response.text
        namespace_id = response.json()["id"]
        self.m.namespaces[namespace_id] = NamespaceSeen(namespace_id, quota, posted_at, now())
        return f"{namespace_id[:8]} {quota} B"

    async def _delete_namespace(self, i: int) -> str:
        live = self.m.namespaces_live()
        if not live:
            return "skipped: no namespace"
        seen = live[i % len(live)]
        seen.delete_asked_at = now()
        response = await self.t.delete(f"/api/v1/storage/namespaces/{seen.id}")
        assert response.status_code in (200, 202), response.text

        async def gone() -> bool:
            view = await self.t.get(f"/api/v1/storage/namespaces/{seen.id}")
            return view.status_code == 404 or view.json().get("status") == "deleted"

        await eventually(gone, timeout=SETTLE_S, interval=0.1)
        seen.deleted_at = now()
        return f"{seen.id[:8]} deleted"

    async def _credit(self, amount: int) -> str:
        """A checkout in the account's currency, paid: Stripe's signed webhook says so."""
        key = f"ledger-{uuid.uuid4()}"
        created = await self.t.post(
            "/api/v1/payments/checkout-session",
            json={"amount_minor": amount, "currency": self.m.currency},
            headers={"X-Idempotency-Key": key},
        )
        assert created.status_code == 201, created.text
        body = created.json()
        event = checkout_event(body["stripe_checkout_session_id"], amount, currency=self.m.currency)
        payload = json.dumps(event).encode()
        delivered = await self.t.post(
            "/api/v1/webhooks/stripe",
            content=payload,
            headers={
                "Content-Type": "application/json",
                "Stripe-Signature": sign(payload, self.rig.webhook_secret),
            },
        )
        assert delivered.status_code == 200, delivered.text
        session_id = body["payment_session_id"]

        async def credited() -> bool:
            sessions = (await self.t.get("/api/v1/payments/sessions")).json()["items"]
            return any(
                s["payment_session_id"] == session_id and s["status"] == "credited"
                for s in sessions
            )

        await eventually(credited, timeout=SETTLE_S, interval=0.1)
        self.m.credits[session_id] = amount
        return f"{session_id[:8]} credited {amount}"

    async def _credit_foreign(self, currency: str) -> str:
        before = (await self.t.get("/api/v1/payments/sessions")).json()["items"]
        refused = await self.t.post(
            "/api/v1/payments/checkout-session",
            json={"amount_minor": 5000, "currency": currency},
            headers={"X-Idempotency-Key": f"ledger-{uuid.uuid4()}"},
        )
        assert refused.status_code == 422, refused.text
        assert refused.json()["error"]["code"] == "currency_mismatch"
        after = (await self.t.get("/api/v1/payments/sessions")).json()["items"]
        assert len(after) == len(before), "a refused checkout created a session"
        return f"{currency} refused"

    async def _expect(self, state: str) -> str:
        """Replays only: the account's state at this point of the sequence."""
        balance = (await self.t.get("/api/v1/billing/balance")).json()
        assert balance["state"] == state, balance
        return f"{state} ({balance['balance_minor']})"

    async def _wait(self, seconds: int) -> str:
        await asyncio.sleep(seconds)
        return f"{seconds} s passed"


async def meter(rig: LedgerRig, until: dt.datetime) -> MeterResult:
    result: MeterResult = await rig.temporal.execute_workflow(
        BillingMeterWorkflow.run,
        MeterInput(until=until.isoformat()),
        id=f"billing-meter-ledger-{uuid.uuid4()}",
        task_queue=rig.app_settings.control_plane_task_queue,
    )
    return result


def play(bridge: LoopBridge, rig: LedgerRig, credit: int, steps: list[tuple[Any, ...]]) -> None:
    world = LedgerWorld(rig, credit)
    try:
        bridge(world.start())
        for step in steps:
            bridge(world.step(step))
        bridge(world.finish())
    finally:
        if world.model is not None:
            print("\n".join(world.model.log))  # the trail, shown on failure (-s: always)


async def test_ledger_properties(ledger_rig: LedgerRig) -> None:
    """Hypothesis draws EXAMPLES sequences of STEPS steps (a fixed seed: derandomize)."""
    bridge = LoopBridge(asyncio.get_running_loop(), STEP_TIMEOUT_S)
    shrink = os.environ.get("GPUCLOUD_LEDGER_SHRINK") == "1"

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        phases=(Phase.explicit, Phase.generate, *((Phase.shrink,) if shrink else ())),
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(
        st.sampled_from([STARTING_CREDIT_MINOR, POOR_CREDIT]),
        st.lists(STEP, min_size=1, max_size=STEPS),
    )
    def explore(credit: int, steps: list[tuple[Any, ...]]) -> None:
        play(bridge, ledger_rig, credit, steps)

    await asyncio.to_thread(explore)


async def replay(rig: LedgerRig, credit: int, steps: list[tuple[Any, ...]]) -> None:
    """A regression test: one explicit step sequence on a fresh project."""
    bridge = LoopBridge(asyncio.get_running_loop(), STEP_TIMEOUT_S)
    await asyncio.to_thread(play, bridge, rig, credit, steps)


async def test_replay_deplete_release_by_billing_then_top_up(ledger_rig: LedgerRig) -> None:
    """Depletion and top-up, which drawn sequences reach only sometimes: a poor project's
    bare-metal allocation spends its credit, the meter releases it (billing stops at the fence),
    a new allocation and namespace are refused 402, a paid checkout lifts the state, and the
    tenant allocates and stores again; a foreign-currency checkout is refused throughout."""
    await replay(
        ledger_rig,
        POOR_CREDIT,
        [
            ("allocate_baremetal",),
            ("namespace", 500 * GB),
            ("wait", 3),
            ("meter", 0),
            ("wait", 3),
            ("wait", 3),
            ("meter", 0),
            ("expect", "depleted"),
            ("allocate_slice", 1),
            ("namespace", GB),
            ("credit_foreign", "eur"),
            ("credit", 5000),
            ("expect", "healthy"),
            ("allocate_slice", 2),
            ("release_failing", 0),
            ("meter", 400),
            ("force_release", 0),
            ("delete_namespace", 0),
            ("meter", 0),
        ],
    )
