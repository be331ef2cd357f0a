"""Stripe payment sessions: the Stripe client wrapper, settings and the activities of
PaymentSessionWorkflow and StripeReconciliationWorkflow."""
