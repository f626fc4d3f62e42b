"""A node's tensor-parallel ranks: worker processes, the group that starts them and hands each
step and its block copies over, and KV per rank pair. Imports only node/ itself."""
