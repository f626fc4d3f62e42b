"""Protocol buffers of pdserve: the public API (pdserve.proto) and the node services (node.proto).

The generated modules are committed; `python -m pdserve.proto.generate` rewrites them,
and a test regenerates them into a temporary folder and diffs. `convert` holds the one
proto <-> engine conversion; importing this package imports none of its modules.
"""
