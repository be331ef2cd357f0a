"""The one sanitiser of free text (core/redaction.py): every shape of secret the timeline's
records must never hold, and the ordinary text around it kept."""

from __future__ import annotations

import pytest

from core.redaction import redact, redact_optional


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        ("login with password=hunter2 failed", "hunter2"),
        ("passwd: s3cret now", "s3cret"),
        ("Authorization: Bearer abc.def.ghi", "abc.def.ghi"),
        ("api_key=AbCdEf123 rejected", "AbCdEf123"),
        ("used gpc_0123456789abcdef", "gpc_0123456789abcdef"),
        ("aws AKIAABCDEFGHIJKLMNOP", "AKIAABCDEFGHIJKLMNOP"),
        (
            "key ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl",
            "AAAAC3NzaC1lZDI1NTE5",
        ),
        (
            # A fake key, assembled so that no private-key block stands in the repository.
            "-----BEGIN RSA "
            + "PRIVATE "
            + "KEY-----\nMIIEowIBAAKCAQEA\n-----END RSA PRIVATE "
            + "KEY-----",
            "MIIEowIBAAKCAQEA",
        ),
        ("seed: #cloud-config\nusers:\n  - name: root\n    plain_text_passwd: x", "root"),
        ("user-data: I2Nsb3VkLWNvbmZpZw", "I2Nsb3VkLWNvbmZpZw"),
        ("blob " + "A1b2" * 10, "A1b2A1b2"),
    ],
)
def test_secret_shapes_are_redacted(text: str, secret: str) -> None:
    cleaned = redact(text)
    assert secret not in cleaned
    assert "[redacted]" in cleaned


def test_ordinary_text_and_ids_are_kept() -> None:
    text = "no IOMMU group for 0000:17:00.0 on 1b4e28ba-2fa1-11d2-883f-0016d3cca427"
    assert redact(text) == text
    assert redact_optional(None) is None
    assert redact("x " * 300, limit=500) == ("x " * 250)[:499] + "…"
