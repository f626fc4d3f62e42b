"""The colocated node: one node runs both phases, the baseline the disaggregated pools are measured against.

The front (server.py) never imports the engine; the engine-core process runs core.py:
the engine's colocated policy, stall-free chunked prefill (running decodes first, prompt
chunks fill the rest of the token budget), no KV transport.
"""
