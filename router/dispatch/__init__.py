"""Sending requests to nodes: the router's shared state (state.py), one sample's attempts
(driver.py) along its route (routes.py), recovery from a lost node (recovery.py), served beam
search (beam.py, beam_pair.py) and the orchestrator that picks among them (orchestrator.py).
Imports router/ itself, cluster/ and requests/."""
