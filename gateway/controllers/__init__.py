"""Thin Litestar controllers, one per resource: parse, authorise, call a use case, shape."""
