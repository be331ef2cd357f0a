"""Node-side Temporal worker: host activities on task queue `node-{node_id}`."""
