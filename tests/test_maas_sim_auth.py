"""The simulated MAAS region's front door: OAuth 1.0 checks and their 401 bodies, anonymous
access, `op` routing (query, form, op-<name> path), unknown endpoints and methods, form bodies."""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
import uuid
from urllib.parse import quote

import httpx

from sim.maas.auth import ApiKey, hmac_base_string, oauth_header
from tests.maas_fixtures import MaasSim

API_HASH_HEADER = "x-maas-api-hash"


def _header(key: ApiKey, **overrides: str | None) -> str:
    values: dict[str, str | None] = {
        "oauth_version": "1.0",
        "oauth_signature_method": "PLAINTEXT",
        "oauth_consumer_key": key.consumer_key,
        "oauth_token": key.token_key,
        "oauth_signature": f"%26{key.token_secret}",
        "oauth_nonce": uuid.uuid4().hex,
        "oauth_timestamp": str(int(time.time())),
    }
    values.update(overrides)
    return "OAuth " + ", ".join(f'{k}="{v}"' for k, v in values.items() if v is not None)


async def _get(sim: MaasSim, path: str, authorization: str | None = None) -> httpx.Response:
    headers = {"Authorization": authorization} if authorization else {}
    async with httpx.AsyncClient(base_url=sim.api_url) as http:
        return await http.get(path, headers=headers)


async def test_version_is_anonymous_and_every_answer_carries_the_api_hash(
    maas_sim: MaasSim,
) -> None:
    response = await _get(maas_sim, "version/")
    assert response.status_code == 200
    body = response.json()
    assert body["version"] == "3.6.0"
    assert body["subversion"] == ""
    assert "authenticate-api" in body["capabilities"]
    assert response.headers[API_HASH_HEADER]
    refused = await _get(maas_sim, "subnets/")
    assert refused.headers[API_HASH_HEADER] == response.headers[API_HASH_HEADER]


async def test_signed_requests_pass(maas_sim: MaasSim) -> None:
    response = await _get(maas_sim, "users/?op=whoami", oauth_header(maas_sim.api_key))
    assert response.status_code == 200
    assert response.json()["username"] == "admin"
    assert response.json()["is_superuser"] is True


async def test_anonymous_requests_get_what_piston_gives_them(maas_sim: MaasSim) -> None:
    system_id = (await maas_sim.machine("node-a"))["system_id"]
    listing = await _get(maas_sim, "machines/")
    assert (listing.status_code, listing.text) == (
        400,
        "Unrecognised signature: method=GET op=None",
    )
    for path in (f"machines/{system_id}/", "subnets/", f"events/?op=query&id={system_id}"):
        response = await _get(maas_sim, path)
        assert (response.status_code, response.text) == (401, "Forbidden"), path
    async with httpx.AsyncClient(base_url=maas_sim.api_url) as http:
        accept = await http.post("machines/?op=accept", data={"machines": system_id})
    assert (accept.status_code, accept.text) == (401, "You must be logged in to accept machines.")


async def test_incomplete_oauth_parameters_are_anonymous(maas_sim: MaasSim) -> None:
    key = ApiKey.parse(maas_sim.api_key)
    response = await _get(maas_sim, "subnets/", _header(key, oauth_nonce=None))
    assert (response.status_code, response.text) == (401, "Forbidden")


async def test_each_oauth_failure_has_its_401_body(maas_sim: MaasSim) -> None:
    key = ApiKey.parse(maas_sim.api_key)
    cases = {
        "Authorization Error: Invalid API key.": _header(key, oauth_consumer_key="nobody"),
        "Authorization Error: 'Invalid access token: stolen'": _header(key, oauth_token="stolen"),
        "Authorization Error: 'OAuth version 2.0 not supported.'": _header(
            key, oauth_version="2.0"
        ),
        f"Authorization Error: 'Invalid signature. Expected signature base string: "
        f"&{key.token_secret}'": _header(key, oauth_signature="%26wrong"),
    }
    for body, header in cases.items():
        response = await _get(maas_sim, "subnets/", header)
        assert response.status_code == 401, body
        assert response.text == body
        assert response.headers["www-authenticate"] == 'OAuth realm="OAuth"'
        assert response.headers["content-type"].startswith("text/plain")


async def test_expired_timestamps_and_reused_nonces_are_refused(maas_sim: MaasSim) -> None:
    key = ApiKey.parse(maas_sim.api_key)
    old = str(int(time.time()) - 301)
    expired = await _get(maas_sim, "subnets/", _header(key, oauth_timestamp=old))
    assert expired.status_code == 401
    assert expired.text.startswith(f"Authorization Error: 'Expired timestamp: given {old} and now")
    assert expired.text.endswith("has a greater difference than threshold 300'")
    not_a_number = await _get(maas_sim, "subnets/", _header(key, oauth_timestamp="soon"))
    assert not_a_number.status_code == 400

    header = _header(key, oauth_nonce="once")
    assert (await _get(maas_sim, "subnets/", header)).status_code == 200
    again = await _get(maas_sim, "subnets/", header)
    assert (again.status_code, again.text) == (
        401,
        "Authorization Error: 'Nonce already used: once'",
    )


async def test_hmac_sha1_signatures_are_accepted(maas_sim: MaasSim) -> None:
    key = ApiKey.parse(maas_sim.api_key)
    params = {
        "oauth_version": "1.0",
        "oauth_signature_method": "HMAC-SHA1",
        "oauth_consumer_key": key.consumer_key,
        "oauth_token": key.token_key,
        "oauth_nonce": uuid.uuid4().hex,
        "oauth_timestamp": str(int(time.time())),
    }
    url = maas_sim.api_url + "machines/"
    base = hmac_base_string("GET", url, [("hostname", "node-a"), *params.items()])
    digest = hmac.new(f"&{key.token_secret}".encode(), base.encode(), hashlib.sha1).digest()
    params["oauth_signature"] = base64.b64encode(digest).decode()
    header = "OAuth " + ", ".join(f'{k}="{quote(v, safe="~")}"' for k, v in params.items())
    response = await _get(maas_sim, "machines/?hostname=node-a", header)
    assert response.status_code == 200, response.text
    assert [m["hostname"] for m in response.json()] == ["node-a"]


async def test_routing_answers_like_the_region(maas_sim: MaasSim) -> None:
    system_id = (await maas_sim.machine("node-a"))["system_id"]
    async with maas_sim.client() as maas:
        unknown = await maas.get("nothing-here/")
        assert (unknown.status_code, unknown.text) == (
            404,
            "Unknown API endpoint: /MAAS/api/2.0/nothing-here/.",
        )
        bad_op = await maas.post(f"machines/{system_id}/", params={"op": "explode"})
        assert (bad_op.status_code, bad_op.text) == (
            400,
            "Unrecognised signature: method=POST op=explode",
        )
        assert (await maas.delete("machines/")).status_code == 405
        missing = await maas.get("machines/aaaaaa/")
        assert (missing.status_code, missing.text) == (404, "No Machine matches the given query.")
        # The op may come from the form body, or from the older op-<name> path.
        in_form = await maas.post("machines/", data={"op": "allocate", "name": "node-a"})
        assert in_form.status_code == 200, in_form.text
        assert in_form.json()["status_name"] == "Allocated"
        in_path = await maas.post(f"machines/{system_id}/op-release")
        assert in_path.status_code == 200, in_path.text
        assert in_path.json()["status_name"] == "Ready"


async def test_multipart_bodies_are_forms_and_json_bodies_are_not(maas_sim: MaasSim) -> None:
    async with maas_sim.client() as maas:
        multipart = await maas.post(
            "subnets/", files={"cidr": (None, "10.9.0.0/31"), "name": (None, "roce-a")}
        )
        assert multipart.status_code == 200, multipart.text
        assert multipart.json()["name"] == "roce-a"
        as_json = await maas.post("subnets/", json={"cidr": "10.9.0.2/31"})
        assert as_json.status_code == 400
        assert as_json.json() == {"cidr": ["This field is required."]}


async def test_a_non_admin_key_validates_but_may_not_administer(maas_sim: MaasSim) -> None:
    """A user the control API adds has a key of its own: it signs requests like any key,
    whoami says it is no superuser, and admin operations answer 403 (PermissionDenied, empty
    body); a reset forgets the user."""
    key = await maas_sim.add_user("viewer")
    whoami = await _get(maas_sim, "users/?op=whoami", oauth_header(key))
    assert whoami.status_code == 200
    assert (whoami.json()["username"], whoami.json()["is_superuser"]) == ("viewer", False)
    admin = await _get(maas_sim, "users/?op=whoami", oauth_header(maas_sim.api_key))
    assert admin.json()["is_superuser"] is True
    listed = await _get(maas_sim, "machines/", oauth_header(key))
    assert listed.status_code == 200
    system_id = next(m["system_id"] for m in listed.json() if m["hostname"] == "node-b")
    async with httpx.AsyncClient(base_url=maas_sim.api_url) as http:
        accept = await http.post(
            "machines/",
            params={"op": "accept"},
            data={"machines": system_id},
            headers={"Authorization": oauth_header(key)},
        )
        subnet = await http.post(
            "subnets/", data={"cidr": "10.9.0.0/24"}, headers={"Authorization": oauth_header(key)}
        )
    assert (accept.status_code, accept.text) == (403, "")
    assert subnet.status_code == 403
    assert (await maas_sim.machine("node-b"))["status_name"] == "New"  # nothing happened
    superuser = await maas_sim.add_user("ops", is_superuser=True)
    assert (await _get(maas_sim, "users/?op=whoami", oauth_header(superuser))).json()[
        "is_superuser"
    ] is True

    await maas_sim.reset()
    assert (await _get(maas_sim, "users/?op=whoami", oauth_header(key))).status_code == 401
