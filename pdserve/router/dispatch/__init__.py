"""Sending requests to nodes: the router's shared state (state.py), what a sample asks of its
nodes (asks.py), one sample's attempts (driver.py: a sampled sequence or a whole beam search)
along its route (routes.py), recovery from a lost node (recovery.py) and the orchestrator that
picks the route and runs a request's samples (orchestrator.py). Imports pdserve/router/ itself, cluster/
and requests/."""
