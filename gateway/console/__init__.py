"""The operator console: server-rendered, admin-only pages on the gateway (issue 25;
docs/console.md).

It reads the same read models and sends the same workflow updates and admin operations as the
admin API (it calls the functions the API's routes call), signs an admin in once with a session
cookie that also opens the codec endpoint, and links every workflow into Temporal Web. No
front-end build: Jinja templates, one stylesheet and one small script, shipped in this package.
"""

from gateway.console.routes import console_router, console_template_config

__all__ = ["console_router", "console_template_config"]
