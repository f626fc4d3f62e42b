"""What every node kind shares, in two parts on import floors, above what all of them read
(config.py: the node config and flags; messages.py: the typed front ↔ core messages; errors.py:
node errors and their one mapping to gRPC status codes):

    core/    the engine-core process: its spawn (spawn.py), the step loop (core_loop.py), the node
             core every kind runs with its KV stages (node_core.py, core_part.py), sibling forks,
             served beam searches' messages, hand-off states, KV done messages, stats, fault drills
    front/   the gRPC front process: running a node (server.py), the async ZMQ client of its core
             (client.py), the servicers, registration and heartbeat, /metrics + /health, the
             proto conversions of node messages

A node's tensor-parallel ranks are a part of their own below pdserve/node/ (pdserve/ranks/, `pdserve.ranks`):
the offline `LLM` starts them too, without the node.

tests/unit/test_layering.py fails on an import up a floor.

Must never: run model code in the front process, block the core's step loop on the network, or
pickle a message between the front and the core.
"""
