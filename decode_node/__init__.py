"""The decode node: gRPC front (server.py), block reservations, KV import, token streaming.

The front (server.py) never imports the engine; the engine-core process runs core.py
(reserve → admit on the done message → decode → stream) and reservations.py (the
reservation table with its write permits and leases).
"""
