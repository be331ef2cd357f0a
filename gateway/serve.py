"""`gpucloud-gateway`: serve the API with uvicorn on GPUCLOUD_GATEWAY_HOST:GPUCLOUD_GATEWAY_PORT
(127.0.0.1:8000 by default). The access log has method, path, status and client; never bodies
or headers."""

from __future__ import annotations

import logging

import uvicorn

from core.config import Settings
from core.crash_traces import enable_crash_traces
from core.gc_tuning import tune_for_service
from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.terminal_relay import UVICORN_WS_OPTIONS


def main() -> None:
    enable_crash_traces()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    config = GatewayConfig.from_env()
    app = create_app(Settings.from_env(), config=config)
    tune_for_service()
    uvicorn.run(
        app,
        host=config.host,
        port=config.port,
        access_log=True,
        server_header=False,
        proxy_headers=False,
        timeout_graceful_shutdown=10,
        loop="uvloop",
        http="httptools",
        **UVICORN_WS_OPTIONS,  # terminal streams (gateway/terminal_relay.py)
        log_config=None,  # keep the logging configured above
    )


if __name__ == "__main__":
    main()
