"""GET /api/v1/payments/sessions (issue 37): a tenant lists its own payment sessions, newest
first, paged by an opaque cursor like the other tenant lists, and never sees another project's.

Against real Temporal, PostgreSQL, the Vault simulator and stripe-mock, through the HTTP API."""

from __future__ import annotations

from typing import Any

import httpx

from tests.lifecycle_support import eventually
from tests.stripe_fixtures import PaymentsFactory, checkout_event

SESSIONS = "/api/v1/payments/sessions"


async def _all_pages(client: httpx.AsyncClient, limit: int) -> list[list[dict[str, Any]]]:
    pages: list[list[dict[str, Any]]] = []
    cursor: str | None = None
    while True:
        params: dict[str, Any] = {"limit": limit}
        if cursor is not None:
            params["cursor"] = cursor
        response = await client.get(SESSIONS, params=params)
        assert response.status_code == 200, response.text
        body = response.json()
        pages.append(body["items"])
        cursor = body["next_cursor"]
        if cursor is None:
            return pages
        assert len(pages) < 20, "the cursor never ends"


async def test_a_tenant_lists_its_own_payment_sessions_newest_first_by_cursor(
    payments: PaymentsFactory, api: Any, make_project: Any, make_token: Any
) -> None:
    mine = await make_project(credit_minor=0)
    plane = await payments(project=mine)
    theirs = await make_project(credit_minor=0)
    other = await api(token=await make_token("tenant", theirs), settings=plane.settings)

    assert (await plane.client.get(SESSIONS)).json() == {"items": [], "next_cursor": None}

    created: list[dict[str, Any]] = []
    for n, amount in enumerate((1000, 1100, 1200, 1300, 1400)):
        response = await plane.checkout(amount, key=f"mine-{n}")
        assert response.status_code == 201, response.text
        created.append(response.json())
    foreign: list[str] = []
    for n in range(2):
        response = await other.post(
            "/api/v1/payments/checkout-session",
            json={"amount_minor": 2000 + n, "currency": "usd"},
            headers={"X-Idempotency-Key": f"theirs-{n}"},
        )
        assert response.status_code == 201, response.text
        foreign.append(response.json()["payment_session_id"])

    # One of mine is paid: it is listed with its new status, in its place.
    paid = created[1]
    delivered = await plane.deliver(checkout_event(paid["stripe_checkout_session_id"], 1100))
    assert delivered.status_code == 200, delivered.text

    async def credited() -> dict[str, Any] | None:
        items = (await plane.client.get(SESSIONS, params={"limit": 200})).json()["items"]
        row = next(i for i in items if i["payment_session_id"] == paid["payment_session_id"])
        return row if row["status"] == "credited" else None

    credited_row = await eventually(credited, timeout=20)
    assert credited_row["credited_amount_minor"] == 1100

    pages = await _all_pages(plane.client, limit=2)
    assert [len(p) for p in pages] == [2, 2, 1]
    listed = [item for page in pages for item in page]
    newest_first = [c["payment_session_id"] for c in reversed(created)]
    assert [i["payment_session_id"] for i in listed] == newest_first
    assert {i["project_id"] for i in listed} == {str(mine.id)}
    assert [i["requested_amount_minor"] for i in listed] == [1400, 1300, 1200, 1100, 1000]
    assert all(i["currency"] == "usd" for i in listed)
    assert {i["status"] for i in listed} == {"initiated", "credited"}
    stamps = [i["created_at"] for i in listed]
    assert stamps == sorted(stamps, reverse=True)

    # The other tenant sees its own two, and none of mine; mine never include its.
    theirs_listed = [i["payment_session_id"] for p in await _all_pages(other, 10) for i in p]
    assert theirs_listed == list(reversed(foreign))
    assert not set(foreign) & {i["payment_session_id"] for i in listed}

    # A cursor from one tenant's list pages only that tenant's rows for another tenant.
    first = (await plane.client.get(SESSIONS, params={"limit": 1})).json()
    crossed = await other.get(SESSIONS, params={"cursor": first["next_cursor"]})
    assert crossed.status_code == 200
    assert {i["project_id"] for i in crossed.json()["items"]} <= {str(theirs.id)}


async def test_a_cursor_this_api_did_not_return_is_400(
    payments: PaymentsFactory, make_project: Any
) -> None:
    plane = await payments(project=await make_project(credit_minor=0))
    for cursor in ("not-a-cursor", "eyJjIjoxfQ"):
        response = await plane.client.get(SESSIONS, params={"cursor": cursor})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "invalid_request"
    for limit in (0, 201):
        response = await plane.client.get(SESSIONS, params={"limit": limit})
        assert response.status_code == 400, response.text


async def test_an_admin_token_is_not_a_tenant_here(
    payments: PaymentsFactory, api: Any, make_token: Any, make_project: Any
) -> None:
    plane = await payments(project=await make_project(credit_minor=0))
    admin = await api(token=await make_token("admin"), settings=plane.settings)
    assert (await admin.get(SESSIONS)).status_code == 403
    anonymous = await api(settings=plane.settings)
    assert (await anonymous.get(SESSIONS)).status_code == 401
