"""MAAS onboarding activities (seed 003 §4.3): one module per concern; the workflow is
workflows/onboarding.py."""
