"""What every node kind shares: the front ↔ engine-core process pair.

Owns the typed messages between a node's gRPC front and its engine-core process, what a
kind plugs into its core (`CorePart`, the `CoreHandler` protocol), the core-process
runner (engine + KV transport + step loop), the front's async ZMQ client, the servicers
the kinds share, the hand-off states of a KV transfer, the node config and flags, the
NodeStats builder, the registration/heartbeat client and the one mapping from node
errors to gRPC status codes.

Must never: run model code in the front process, block the core's step loop on the
network, or pickle a message between the front and the core.
"""
