"""What every deployed process does at start, whatever it runs: native crashes leave a trace in
its log, it tells Temporal which process it is, it reads payloads encrypted with a rotated-out
key, and it speaks TLS to a Temporal cluster when told to."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from temporalio.api.common.v1 import Payload
from temporalio.service import TLSConfig

from core.codec import AesGcmPayloadCodec
from core.config import Settings
from core.temporal import data_converter, process_identity, tls_config
from devstack.processes import free_port

REPO = Path(__file__).resolve().parent.parent


def _key(fill: bytes) -> str:
    return base64.b64encode(fill * 32).decode()


def test_gateway_process_writes_a_native_crash_trace_to_its_log(tmp_path: Path) -> None:
    port = free_port()
    log = (tmp_path / "gateway.log").open("wb")
    env = {
        **os.environ,
        "GPUCLOUD_GATEWAY_PORT": str(port),
        # Nothing listens there: the gateway starts anyway and answers 503s.
        "GPUCLOUD_DATABASE_URL": f"postgresql+asyncpg://nobody@127.0.0.1:{free_port()}/none",
        "GPUCLOUD_TEMPORAL_ADDRESS": f"127.0.0.1:{free_port()}",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.serve"], cwd=REPO, env=env, stdout=log, stderr=log
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/healthz")
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "gateway did not start"
                assert proc.poll() is None, (tmp_path / "gateway.log").read_text()
                time.sleep(0.2)
        # What a segfault inside a compiled extension delivers.
        proc.send_signal(signal.SIGSEGV)
        assert proc.wait(timeout=15) == -signal.SIGSEGV
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    text = (tmp_path / "gateway.log").read_text()
    assert "Fatal Python error: Segmentation fault" in text
    assert "most recent call first" in text  # the Python stack of the threads


def test_each_process_has_its_own_temporal_identity() -> None:
    here = process_identity("gpucloud-control-plane")
    assert here.startswith("gpucloud-control-plane@")
    assert here.endswith(f":{os.getpid()}")
    other = subprocess.run(
        [
            sys.executable,
            "-c",
            "from core.temporal import process_identity as p;print(p('gpucloud-control-plane'))",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert other != here


async def test_payloads_written_with_a_rotated_out_key_stay_readable() -> None:
    old, new = _key(b"o"), _key(b"n")
    before = Settings.from_env({"GPUCLOUD_CODEC_KEY": old})
    after = Settings.from_env({"GPUCLOUD_CODEC_KEY": new, "GPUCLOUD_CODEC_OLD_KEYS": old})
    written = await AesGcmPayloadCodec(before.codec_key).encode([Payload(data=b"ssh-ed25519 x")])

    converter = data_converter(after.codec_key, after.codec_old_keys)
    assert converter.payload_codec is not None
    assert (await converter.payload_codec.decode(written))[0].data == b"ssh-ed25519 x"
    # New payloads use the new key only: a process that has only the new key reads them.
    rewritten = await converter.payload_codec.encode([Payload(data=b"again")])
    assert (await AesGcmPayloadCodec(after.codec_key).decode(rewritten))[0].data == b"again"
    # Without the old key configured, the old payload is refused, not misread.
    with pytest.raises(ValueError, match="unknown key id"):
        await AesGcmPayloadCodec(after.codec_key).decode(written)


def test_malformed_old_key_is_refused_at_start() -> None:
    settings = Settings.from_env({"GPUCLOUD_CODEC_OLD_KEYS": base64.b64encode(b"short").decode()})
    with pytest.raises(ValueError, match="GPUCLOUD_CODEC_OLD_KEYS"):
        _ = settings.codec_old_keys


def test_temporal_tls_is_off_by_default_and_mutual_when_configured(tmp_path: Path) -> None:
    assert tls_config(Settings.from_env({})) is False
    for name in ("ca.pem", "client.pem", "client.key"):
        (tmp_path / name).write_bytes(f"-- {name} --".encode())
    mtls = tls_config(
        Settings.from_env(
            {
                "GPUCLOUD_TEMPORAL_TLS_CA_FILE": str(tmp_path / "ca.pem"),
                "GPUCLOUD_TEMPORAL_TLS_CERT_FILE": str(tmp_path / "client.pem"),
                "GPUCLOUD_TEMPORAL_TLS_KEY_FILE": str(tmp_path / "client.key"),
                "GPUCLOUD_TEMPORAL_TLS_SERVER_NAME": "temporal.internal",
            }
        )
    )
    assert isinstance(mtls, TLSConfig)
    assert mtls.server_root_ca_cert == b"-- ca.pem --"
    assert mtls.client_cert == b"-- client.pem --"
    assert mtls.client_private_key == b"-- client.key --"
    assert mtls.domain == "temporal.internal"
    with pytest.raises(ValueError, match="go together"):
        tls_config(
            Settings.from_env({"GPUCLOUD_TEMPORAL_TLS_CERT_FILE": str(tmp_path / "client.pem")})
        )
