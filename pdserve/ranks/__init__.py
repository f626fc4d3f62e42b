"""An engine on tensor-parallel ranks: the worker processes (tp_worker.py), the group that starts
them and hands each step and its block copies over (tp_group.py; worker_link.py, one worker's
pipe, on the typed messages of tp_wire.py), and KV per rank pair (kv_ranks.py).

Below pdserve/node/: a node's engine core and the offline `LLM` both start their ranks here
(`start_engine`). Imports only engine, kernels, kv_transfer and common; never gRPC or ZMQ.
"""
