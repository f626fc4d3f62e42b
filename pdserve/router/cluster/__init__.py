"""The router's view of the cluster: which nodes there are (registry.py), whether they are alive
(liveness.py), what they can hold (node_facts.py) and which one a request goes to (placement.py).
Imports only pdserve/router/ itself."""
