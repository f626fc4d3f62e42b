"""Why an engine refuses a request: bad input, or KV that can never fit its cache.

`RequestRejected` names the field at fault (the offline API raises it to the caller).
`KVCapacityExceeded` is the one capacity rule's answer: the request's KV — prompt plus
`max_tokens`, capped at the model's length — needs more blocks than the engine has in
all. That is the engine's limit, not bad input: a node answers it RESOURCE_EXHAUSTED so
the router tries a node with more blocks (pdserve/node/errors.py), and only the router, which
knows every node, refuses such a request as invalid.

Must never: import torch (a node's front maps these types onto status codes).
"""

from __future__ import annotations


class RequestRejected(ValueError):
    """A request this engine can never serve; the message names the field at fault."""


class KVCapacityExceeded(RequestRejected):
    """The request's KV needs `blocks_needed` blocks; this engine has `num_blocks` in all."""

    def __init__(self, blocks_needed: int, num_blocks: int) -> None:
        super().__init__(f"prompt_token_ids + max_tokens need {blocks_needed} KV blocks; "
                         f"this engine has {num_blocks}")
        self.blocks_needed = blocks_needed
        self.num_blocks = num_blocks
