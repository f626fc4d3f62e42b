"""The prefill node's KV export stage: prefill-only policy (policy.py), admission
(kv_export.py), pushes, done message and leases (exporter.py), one KV connection per decode node
(peers.py), the decode nodes' KV layouts parsed once per id (decode_layouts.py). A prefill node is
the node core with this stage (pdserve/node_kinds.py); its front (server.py, the `PrefillNode`
service; layout_fetch.py, each decode node's layout fetched once per run of it) never imports the
engine.
"""
