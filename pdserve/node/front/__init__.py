"""A node's gRPC front process: running a node, the client of its engine core, the servicers,
registration and heartbeat, /metrics and /health. Never loads torch. The top floor of pdserve/node/."""
