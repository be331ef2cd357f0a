"""Billing: the ledger, usage windows, metering and balance enforcement (seed 001 §3-§4)."""
