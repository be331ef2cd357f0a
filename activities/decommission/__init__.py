"""Activities of NodeDecommissionWorkflow (seed 003 §5): control-plane stages, reimage stages
that reuse the onboarding stage bodies, node-task bookkeeping and the read model."""
