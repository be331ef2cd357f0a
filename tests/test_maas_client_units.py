"""The MAAS client's pure parts: API-key parsing, the OAuth header, image names, the failure
taxonomy, status names and numbers, hardware-sync health, and secret scrubbing. No server."""

from __future__ import annotations

import datetime as dt
import re
from urllib.parse import unquote

import msgspec
import pytest
from temporalio.exceptions import ActivityError, ApplicationError, RetryState

from activities.maas.auth import oauth_header, parse_api_key
from activities.maas.errors import MaasAuthError, MaasStateConflict, redact, status_named_in
from activities.maas.images import is_custom_image, normalise_distro_series
from activities.maas.types import (
    HardwareSync,
    MachineState,
    MachineStatus,
    machine_states_json,
    parse_datetime,
)
from core.failures import (
    DEFAULT_HANDLING,
    ClassifiedError,
    FailureClass,
    NextStep,
    application_error,
    failure_class_of,
    to_application_error,
)

KEY = "cOnSuMeRkEy123456:ToKeNkEy987654321:SeCrEtSeCrEtSeCrEtSeCrEt12345678"
CONSUMER, TOKEN, SECRET = KEY.split(":")


@pytest.fixture(autouse=True)
def clean_db() -> None:
    """These tests touch no database: override the suite's autouse table cleaner."""


# ---------------------------------------------------------------------------- API key


def test_api_key_parses_three_parts_and_hides_secrets_in_repr() -> None:
    key = parse_api_key(f"  {KEY}\n")
    assert (key.consumer_key, key.token_key, key.token_secret) == (CONSUMER, TOKEN, SECRET)
    assert TOKEN not in repr(key)
    assert SECRET not in repr(key)


@pytest.mark.parametrize(
    "raw",
    [
        "ckXYZ123",
        "ckXYZ123:skXYZ789",
        "ckXYZ123:tkXYZ456:skXYZ789:extraXYZ",
        "ckXYZ123::skXYZ789",
        ":tkXYZ456:skXYZ789",
        "ckXYZ123:tkXYZ456:",
        "ckXYZ123:tk XYZ456:skXYZ789",
        "ckXYZ123:tkXYZ456:sk\tXYZ789",
        "ckXYZ123:tkXYZ456:skXYZé789",
    ],
)
def test_api_key_with_a_bad_shape_is_a_value_error_that_does_not_echo_it(raw: str) -> None:
    with pytest.raises(ValueError, match="MAAS API key") as info:
        parse_api_key(raw)
    assert "XYZ" not in str(info.value)


def test_oauth_header_is_plaintext_with_a_fresh_nonce_each_time() -> None:
    key = parse_api_key(KEY)
    first, second = oauth_header(key), oauth_header(key)
    params = dict(re.findall(r'(\w+)="([^"]*)"', first))
    assert first.startswith("OAuth ")
    assert params["oauth_version"] == "1.0"
    assert params["oauth_signature_method"] == "PLAINTEXT"
    assert params["oauth_consumer_key"] == CONSUMER
    assert params["oauth_token"] == TOKEN
    # consumer secret (empty) & token secret, percent-encoded as oauthlib does
    assert params["oauth_signature"] == f"%26{SECRET}"
    assert unquote(params["oauth_signature"]) == f"&{SECRET}"
    assert abs(int(params["oauth_timestamp"]) - int(dt.datetime.now(dt.UTC).timestamp())) < 5
    second_params = dict(re.findall(r'(\w+)="([^"]*)"', second))
    assert params["oauth_nonce"] != second_params["oauth_nonce"]


def test_oauth_header_percent_encodes_reserved_characters() -> None:
    key = parse_api_key("ck:tk:se/cr+et=")
    params = dict(re.findall(r'(\w+)="([^"]*)"', oauth_header(key, nonce="n", timestamp=1)))
    assert params["oauth_signature"] == "%26se%2Fcr%2Bet%3D"
    assert params["oauth_timestamp"] == "1"


# ---------------------------------------------------------------------------- images


@pytest.mark.parametrize(
    ("given", "sent"),
    [
        ("gpuaas-h100-2404", "custom/gpuaas-h100-2404"),
        (" gpuaas-a100 ", "custom/gpuaas-a100"),
        ("custom/gpuaas-h100-2404", "custom/gpuaas-h100-2404"),
        ("custom/site-image", "custom/site-image"),
        ("noble", "noble"),
        ("ubuntu/noble", "ubuntu/noble"),
        ("24.04", "24.04"),
        ("centos/8", "centos/8"),
    ],
)
def test_image_names_are_normalised_at_the_maas_boundary(given: str, sent: str) -> None:
    assert normalise_distro_series(given) == sent


def test_custom_image_detection_and_empty_names() -> None:
    assert is_custom_image("gpuaas-h100")
    assert not is_custom_image("ubuntu/jammy")
    for bad in ("", "  ", "custom/"):
        with pytest.raises(ValueError, match="empty"):
            normalise_distro_series(bad)


# ---------------------------------------------------------------------------- taxonomy


def test_the_taxonomy_is_seed_003_section_4_7() -> None:
    assert [c.value for c in FailureClass] == [
        "input_config_error",
        "site_capability_missing",
        "upstream_transient",
        "bmc_power_failure",
        "pxe_discovery_failure",
        "hardware_mismatch",
        "deploy_cloud_init_failure",
        "post_deploy_connectivity_failure",
        "hardware_sync_failure",
        "agent_enrollment_failure",
        "state_ambiguity",
        # Not in §4.7: a node an operator protected (issue 35); nothing retries past it.
        "node_protected",
    ]
    assert set(DEFAULT_HANDLING) == set(FailureClass)
    not_retried = {c for c, h in DEFAULT_HANDLING.items() if not h.retryable}
    assert not_retried == {
        FailureClass.INPUT_CONFIG_ERROR,
        FailureClass.SITE_CAPABILITY_MISSING,
        FailureClass.HARDWARE_MISMATCH,
        FailureClass.DEPLOY_CLOUD_INIT_FAILURE,
        FailureClass.STATE_AMBIGUITY,
        FailureClass.NODE_PROTECTED,
    }
    assert DEFAULT_HANDLING[FailureClass.NODE_PROTECTED].then == NextStep.UNPROTECT
    assert DEFAULT_HANDLING[FailureClass.STATE_AMBIGUITY].then == NextStep.RECONCILE
    assert DEFAULT_HANDLING[FailureClass.DEPLOY_CLOUD_INIT_FAILURE].then == NextStep.RECOVERY_PATH


def test_application_errors_carry_the_class_and_its_default_retryability() -> None:
    transient = application_error(FailureClass.UPSTREAM_TRANSIENT, "MAAS timed out")
    assert (transient.type, transient.non_retryable) == ("upstream_transient", False)
    auth = to_application_error(MaasAuthError("bad key", operation="GET version/"), {"x": 1})
    assert (auth.type, auth.non_retryable, auth.details) == (
        "site_capability_missing",
        True,
        ({"x": 1},),
    )
    forced = application_error(FailureClass.UPSTREAM_TRANSIENT, "gave up", non_retryable=True)
    assert forced.non_retryable


def test_failure_class_is_read_back_through_temporal_wrappers() -> None:
    conflict = MaasStateConflict("409", operation="POST machines/x/?op=deploy")
    assert failure_class_of(conflict) == FailureClass.STATE_AMBIGUITY
    assert failure_class_of(ClassifiedError("x", failure_class=FailureClass.HARDWARE_MISMATCH)) == (
        FailureClass.HARDWARE_MISMATCH
    )
    wrapped = ActivityError(
        "activity failed",
        scheduled_event_id=1,
        started_event_id=2,
        identity="w",
        activity_type="maas.deploy",
        activity_id="1",
        retry_state=RetryState.NON_RETRYABLE_FAILURE,
    )
    wrapped.__cause__ = to_application_error(conflict)
    assert failure_class_of(wrapped) == FailureClass.STATE_AMBIGUITY
    assert failure_class_of(ApplicationError("x", type="something_else")) is None
    assert failure_class_of(RuntimeError("x")) is None


# ---------------------------------------------------------------------------- statuses


def test_machine_status_numbers_and_names_are_maas_own() -> None:
    expected = {
        0: "New",
        1: "Commissioning",
        2: "Failed commissioning",
        3: "Missing",
        4: "Ready",
        5: "Reserved",
        6: "Deployed",
        7: "Retired",
        8: "Broken",
        9: "Deploying",
        10: "Allocated",
        11: "Failed deployment",
        12: "Releasing",
        13: "Releasing failed",
        14: "Disk erasing",
        15: "Failed disk erasing",
        16: "Rescue mode",
        17: "Entering rescue mode",
        18: "Failed to enter rescue mode",
        19: "Exiting rescue mode",
        20: "Failed to exit rescue mode",
        21: "Testing",
        22: "Failed testing",
    }
    assert {s.value: s.label for s in MachineStatus} == expected
    for number, label in expected.items():
        assert MachineStatus.from_label(label) == MachineStatus(number)
    assert MachineStatus.FAILED_DEPLOYMENT.is_failure
    assert MachineStatus.BROKEN.is_failure
    assert not MachineStatus.DEPLOYED.is_failure


@pytest.mark.parametrize(
    ("text", "status"),
    [
        ("Can't deploy a machine that is in the 'Failed deployment' state", 11),
        ("Machine cannot be released in its current state ('New').", 0),
        ("Cannot abort in current state: node abc123 is in state Ready.", 4),
        ("Can't start node: it hasn't been allocated.", None),
    ],
)
def test_state_conflicts_name_the_current_status(text: str, status: int | None) -> None:
    found = status_named_in(text)
    assert (None if found is None else found.value) == status


# ---------------------------------------------------------------------------- hardware sync

LAST = dt.datetime(2026, 1, 2, 3, 0, 0, tzinfo=dt.UTC)


def _sync(**fields: object) -> HardwareSync:
    data = {"enable_hw_sync": True, "last_sync": "2026-01-02T03:00:00.000Z", "sync_interval": 900}
    data.update(fields)
    return HardwareSync.from_machine_json(data)


def test_hardware_sync_is_healthy_until_one_and_a_half_intervals_have_passed() -> None:
    sync = _sync()
    assert sync.available
    assert sync.enabled
    assert sync.last_sync == LAST
    assert sync.sync_interval == dt.timedelta(minutes=15)
    assert sync.healthy(LAST)
    assert sync.healthy(LAST + dt.timedelta(seconds=1350))  # exactly 1.5 * 900 s
    assert not sync.healthy(LAST + dt.timedelta(seconds=1351))


@pytest.mark.parametrize(
    "fields",
    [
        {"enable_hw_sync": False},
        {"last_sync": None},
        {"sync_interval": None},
        {"sync_interval": 0},
    ],
)
def test_hardware_sync_is_unhealthy_without_each_of_its_inputs(fields: dict[str, object]) -> None:
    assert not _sync(**fields).healthy(LAST)


def test_hardware_sync_fields_absent_on_an_older_maas() -> None:
    sync = HardwareSync.from_machine_json({"system_id": "abc123"})
    assert not sync.available
    assert not sync.healthy(LAST)


def test_naive_maas_datetimes_read_as_utc() -> None:
    # MAAS ≤ 3.5 sends naive datetimes, ≥ 3.6 a Z suffix: both mean the same instant.
    assert parse_datetime("2026-01-02T03:04:05.678") == parse_datetime("2026-01-02T03:04:05.678Z")
    sync = _sync(last_sync="2026-01-02T03:00:00.000")
    assert sync.healthy(dt.datetime(2026, 1, 2, 3, 10))  # naive `now` is UTC too


# ---------------------------------------------------------------------------- redaction


def test_redact_removes_raw_and_percent_encoded_secrets() -> None:
    text = (
        f"Authorization Error: 'Invalid access token: {TOKEN}' "
        f"Expected signature base string: %26{SECRET} / &{SECRET} / se%2Fcr"
    )
    scrubbed = redact(text, [CONSUMER, TOKEN, SECRET, "se/cr", ""])
    assert TOKEN not in scrubbed
    assert SECRET not in scrubbed
    assert "se%2Fcr" not in scrubbed
    assert "***" in scrubbed


def test_machine_states_decode_only_their_keys_and_refuse_another_shape() -> None:
    body = (
        b'[{"system_id": "abc", "status": 6, "hostname": "n1", "power_state": "on",'
        b' "ip_addresses": ["10.0.0.5"], "interface_set": [{"id": 1}], "storage": 1.5},'
        b' {"system_id": "def", "status": 4, "enable_hw_sync": false}]'
    )
    entries = machine_states_json(body)
    assert entries[0] == {
        "system_id": "abc",
        "status": 6,
        "hostname": "n1",
        "power_state": "on",
        "ip_addresses": ["10.0.0.5"],
    }
    deployed, ready = (MachineState.from_json(e) for e in entries)
    assert (deployed.status_name, deployed.ip_addresses) == ("Deployed", ("10.0.0.5",))
    assert not deployed.hardware_sync.available  # a MAAS without the sync fields
    assert ready.hardware_sync.available
    assert ready.power_state == "unknown"
    for wrong in (b"{", b'{"system_id": "abc"}', b'[{"status": 6}]'):
        with pytest.raises(msgspec.DecodeError):
            machine_states_json(wrong)
