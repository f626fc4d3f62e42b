"""The prefill-only scheduling policy: a request leaves the engine at its first token.

The engine hands the request off instead of finishing it: the step's output for that
token carries the request's blocks, still referenced (`EngineCoreOutput.handoff_blocks`),
and the KV exporter frees them once every push reading them has finished. Whether token
1 stops the request is for the decode node to say. Must never: free a block, or hold one.
"""

from __future__ import annotations

from pdserve.engine.policy import SchedulingPolicy


class PrefillPolicy(SchedulingPolicy):
    def hands_off_after_first_token(self) -> bool:
        return True
