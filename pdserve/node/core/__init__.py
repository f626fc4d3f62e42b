"""A node's engine-core process: its spawn, the step loop, and the node core every kind runs with
its KV stages. Imports pdserve/node/ itself (and the ranks part below pdserve/node/). spawn.py and core_part.py are light (the front
imports them); the rest loads torch in the core process only."""
