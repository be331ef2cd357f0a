"""Billing: the ledger, usage windows, metering and balance enforcement
(docs/billing.md#metering-and-balances, docs/lifecycles/balance.md)."""
