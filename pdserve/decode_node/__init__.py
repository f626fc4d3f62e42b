"""The decode node's KV import stage: block reservations (reservations.py) and the stage that
reserves, receives a prefill node's KV and hands the request to the node core to decode
(kv_import.py). A decode node is the node core with this stage (pdserve/node_kinds.py); its
front is pdserve/node/front/servicers.py's `StreamServicer`, which never imports the engine.
"""
