"""The prefill node: gRPC front (server.py), prefill-only policy, KV export to decode nodes.

The front (server.py) never imports the engine; the engine-core process runs
core.py (admission), exporter.py (pushes, done message, leases) and peers.py
(one KV connection per decode node).
"""
