"""The HTTP gateway: tenant, admin and codec APIs over Litestar.

It starts, signals, queries and updates Temporal workflows and reads the SQL read models; the
only tables it writes are the identity tables (projects, api_tokens, ssh_keys) and audit_log.
"""
