"""The simulator as an ASGI app: the MAAS API under /MAAS/api/2.0/ and the out-of-band control
API under /_sim/ (sim.maas.control).

A raw ASGI app rather than a framework's router, because MAAS routes on (method, `op`) with the
op taken from the query string, the form body or an `op-<name>` path, answers unknown ops with
400 and unexported methods with 405, and decides between anonymous and signed handling per
resource; all of that is a few lines here and a fight with a router.

One API request: count it, apply request faults (slow, 5xx), advance the region's clock,
authenticate, dispatch to the handler, and render what it returns (or the ApiError it raises).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl

from sim.maas import api_machines, control, routes
from sim.maas.auth import Authenticator, RequestFacts
from sim.maas.build import build_region
from sim.maas.context import Ctx
from sim.maas.counters import Counters
from sim.maas.errors import TEXT, ApiError, bad_request, forbidden, unauthorized
from sim.maas.faults import HTTP_ERROR, SLOW, TRUNCATE_LIST, FaultSpec
from sim.maas.http import Params, Request, Response, parse_form
from sim.maas.region import Region
from sim.maas.scenario import Scenario

logger = logging.getLogger("sim.maas")

API_PREFIX = "/MAAS/api/2.0/"
CONTROL_PREFIX = "/_sim/"
# The region sends a hash of its API description with every answer; ours is fixed.
API_HASH = hashlib.sha1(b"gpucloud-maas-simulator/api-2.0").hexdigest()  # noqa: S324 - not security
_STATUS_TEXT = {
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


@dataclass
class Simulator:
    """What persists across resets: the keys, the control token and the counters; the region is
    rebuilt from a scenario on reset."""

    region: Region
    auth: Authenticator
    control_token: str
    counters: Counters = field(default_factory=Counters)
    default_time_scale: float | None = None  # the CLI's --time-scale, if given

    def reset(self, scenario: Scenario, time_scale: float | None = None) -> None:
        """The time scale: this call's, else the scenario's, else the CLI's, else 1."""
        scale = time_scale if time_scale is not None else scenario.time_scale
        if scale is None:
            scale = self.default_time_scale
        self.region = build_region(scenario, scale)
        self.auth.username = scenario.site.admin_user
        self.auth.forget_nonces()
        self.auth.forget_users()
        self.counters.reset()


class MaasApp:
    def __init__(self, sim: Simulator) -> None:
        self.sim = sim

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        body = await _read_body(receive)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        query_pairs = parse_qsl(scope.get("query_string", b"").decode(), keep_blank_values=True)
        form = parse_form(headers.get("content-type", ""), body)
        request = Request(
            method=scope["method"].upper(),
            path=scope["path"],
            query=Params.from_pairs(query_pairs),
            form=form,
            headers=headers,
        )
        try:
            if request.path.startswith(CONTROL_PREFIX):
                response = control.handle(self.sim, request, body)
            elif request.path.startswith(API_PREFIX):
                response = await self._api(request, query_pairs, form, scope)
            else:
                response = Response.text("Not Found", 404)
        except Exception:  # a bug of ours: answer like Django's 500, keep serving
            logger.exception("unhandled error in %s %s", request.method, request.path)
            response = Response.text("Internal server error.", 500)
        await _send(send, response)

    async def _api(
        self, request: Request, query_pairs: list[tuple[str, str]], form: Params, scope: Scope
    ) -> Response:
        sim = self.sim
        found = routes.match(request.path[len(API_PREFIX) :])
        if found is None:
            sim.counters.request("unknown", None)
            return _with_hash(Response.text(f"Unknown API endpoint: {request.path}.", 404))
        resource, method = found.resource, request.method
        op = request.query.get("op")
        if op is None and method != "GET":
            op = form.get("op")
        op = op or found.path_op
        op_name = f"{resource.name}.{op or routes.DEFAULT_OP_NAMES.get(method, method.lower())}"
        system_id = found.args.get("system_id")
        sim.counters.request(op_name, system_id)
        if op_name == "machines.read" and not api_machines.is_filtered(request.params):
            sim.counters.request("machines.read_unfiltered", None)
        if method not in resource.methods:
            return self._answer(
                op_name, Response(405, b"", TEXT, {"Allow": ", ".join(sorted(resource.methods))})
            )

        sim.region.advance()
        slow = self._request_fault(SLOW, op_name, system_id)
        if slow is not None:
            region = sim.region
            await asyncio.sleep(slow.delay)
            if sim.region is not region:
                # The simulator was reset while this request slept: it belongs to a world that
                # no longer exists and must not change the new one.
                return self._answer(op_name, Response.text("Service Unavailable", 503))
            sim.region.advance()
        failure = self._request_fault(HTTP_ERROR, op_name, system_id)
        if failure is not None and not failure.applied:
            return self._answer(op_name, _injected_error(failure))

        facts = RequestFacts(
            method=method,
            url=f"http://{request.headers.get('host', 'localhost')}{request.path}",
            params=[*query_pairs, *((k, v) for k, vs in form.data.items() for v in vs)],
        )
        response = self._dispatch(request, found, op, op_name, facts)
        if failure is not None:  # applied: the change happened, the answer is lost
            response = _injected_error(failure)
        return self._answer(op_name, response)

    def _request_fault(self, kind: str, op_name: str, system_id: str | None) -> FaultSpec | None:
        region = self.sim.region
        machine = region.machines.get(system_id) if system_id else None
        refs = [system_id] if system_id else []
        if machine is not None:
            refs.append(machine.hostname)
            if machine.hardware is not None:
                refs.append(machine.hardware.spec.hostname)
        spec = region.request_faults.take_request(kind, op_name, region.rng, refs)
        if spec is None and machine is not None and machine.hardware is not None:
            spec = machine.hardware.faults.take_request(kind, op_name, region.rng, refs)
        return spec

    def _dispatch(
        self,
        request: Request,
        found: routes.Match,
        op: str | None,
        op_name: str,
        facts: RequestFacts,
    ) -> Response:
        sim, resource, method = self.sim, found.resource, request.method
        unrecognised = f"Unrecognised signature: method={method} op={op}"
        try:
            user = sim.auth.authenticate(request.headers.get("authorization"), facts)
            if user is None:
                handler = resource.anonymous.get((method, op))
                if handler is None and method in resource.anonymous_methods:
                    raise bad_request(unrecognised)
                if handler is None:
                    # piston's challenge: rc.FORBIDDEN, which is a 401.
                    raise unauthorized("Forbidden", challenge=False)
            else:
                handler = resource.ops.get((method, op))
                if handler is None:
                    raise bad_request(unrecognised)
            account = sim.auth.user(user)
            is_superuser = account is not None and account.is_superuser
            if account is not None and not is_superuser:
                self._check_permission(op_name, user, found.args.get("system_id"))
            result = handler(Ctx(sim.region, request, user, op, is_superuser), **found.args)
            if isinstance(result, list):
                cut = self._request_fault(TRUNCATE_LIST, op_name, found.args.get("system_id"))
                if cut is not None:
                    result = result[: cut.keep]
        except ApiError as error:
            return Response(error.status, error.encoded(), error.content_type, error.headers)
        return result if isinstance(result, Response) else Response.json(result)

    def _check_permission(self, op_name: str, user: str | None, system_id: str | None) -> None:
        """A non-admin's request: PermissionDenied (403, empty body) for admin operations, and
        for machine changes on a machine someone else owns."""
        if op_name in routes.ADMIN_ONLY_OPS:
            raise forbidden()
        if op_name in routes.MACHINE_EDIT_OPS and system_id is not None:
            machine = self.sim.region.machines.get(system_id)
            if machine is not None and machine.owner not in (None, user):
                raise forbidden()

    def _answer(self, op_name: str, response: Response) -> Response:
        self.sim.counters.answer(op_name, response.status)
        return _with_hash(response)


def _injected_error(spec: FaultSpec) -> Response:
    return Response.text(spec.message or _STATUS_TEXT.get(spec.status, "Server Error"), spec.status)


def _with_hash(response: Response) -> Response:
    response.headers["X-MAAS-API-Hash"] = API_HASH
    return response


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _send(send: Send, response: Response) -> None:
    headers = [(b"content-type", response.content_type.encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in response.headers.items()]
    headers.append((b"content-length", str(len(response.body)).encode()))
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    await send({"type": "http.response.body", "body": response.body})


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
