"""The prefill node's KV export stage: prefill-only policy (policy.py), admission
(kv_export.py), pushes, done message and leases (exporter.py), one KV connection per decode node
(peers.py). A prefill node is the node core with this stage (pdserve/node_kinds.py); its front
(server.py, the `PrefillNode` service) never imports the engine.
"""
