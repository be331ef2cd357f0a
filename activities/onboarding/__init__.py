"""MAAS onboarding activities (docs/lifecycles/onboarding.md#stages): one module per concern; the
workflow is workflows/onboarding.py."""
