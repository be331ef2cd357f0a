"""Pieces shared by every process of the control plane: settings, the Temporal payload codec,
the Temporal client factory, search attributes and task-queue names."""
