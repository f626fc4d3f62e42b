"""What every node kind shares, in three parts on import floors, above what all of them read
(config.py: the node config and flags; messages.py: the typed front ↔ core messages; errors.py:
node errors and their one mapping to gRPC status codes; affinity.py: CPU pinning):

    ranks/   a node's tensor-parallel ranks: the worker processes (tp_worker.py), the group that
             starts them and hands each step over (tp_group.py, tp_wire.py), KV per rank pair
             (kv_ranks.py); the offline `LLM` starts its ranks here too
    core/    the engine-core process: its spawn (spawn.py), the step loop (core_loop.py), the node
             core every kind runs with its KV stages (node_core.py, core_part.py), sibling forks,
             served beam searches' messages, hand-off states, KV done messages, stats, fault drills
    front/   the gRPC front process: running a node (server.py), the async ZMQ client of its core
             (client.py), the servicers, registration and heartbeat, /metrics + /health, the
             proto conversions of node messages

tests/unit/test_layering.py fails on an import up a floor.

Must never: run model code in the front process, block the core's step loop on the network, or
pickle a message between the front and the core.
"""
