"""One request at the router: its checks (validation.py, beam_option.py), its admission
(admission.py), its tokens to the client (relay.py) and its samples' streams merged (merge.py).
Imports pdserve/router/ itself and cluster/."""
