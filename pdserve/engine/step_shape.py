"""The shape of one engine step, and the running sums of an engine's steps.

`StepShape` is what a step's cost depends on (pdserve/planner/step_cost.py prices it): the
scheduled tokens (the rows every weight matrix multiplies), the requests in it, the query-key
pairs of its prompt chunks (`attended`: a chunk of n tokens after c computed ones attends
n·c + n(n+1)/2 pairs) and the tokens of KV its decodes read (`decode_context`: c + 1 for a
decode over c tokens).

`StepTotals` sums those fields over every step an engine ran, with the seconds its model took:
on the clock and in the stepping thread's CPU. The planner's step model is linear in the fields,
so what it predicts for all those steps is the model applied to the sums; a node's observed
seconds against that prediction say how fast its steps really run beside everything else on
the machine (pdserve/planner/step_speed.py). The thread's CPU leaves out the time the thread was
not running (the simulator charges the processes that took it), and keeps what running beside
them costs: a step that runs slower for the caches and memory it shares.

Must never: import torch (a node's front carries `StepTotals` in its stats).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepShape:
    tokens: int
    requests: int
    attended: int  # query-key pairs of the prompt chunks
    decode_context: int  # KV tokens the decodes read

    @classmethod
    def of(cls, chunks: Iterable[tuple[int, int]]) -> StepShape:
        """From (tokens computed before, tokens scheduled) of each request in the step; a request
        scheduling one token after others is a decode."""
        tokens = requests = attended = decode_context = 0
        for computed, scheduled in chunks:
            tokens += scheduled
            requests += 1
            if scheduled == 1 and computed > 0:
                decode_context += computed + 1
            else:
                attended += scheduled * computed + scheduled * (scheduled + 1) // 2
        return cls(tokens, requests, attended, decode_context)

    def features(self) -> tuple[float, ...]:
        return 1.0, float(self.tokens), float(self.requests), float(self.attended), float(self.decode_context)


@dataclass(slots=True)
class StepTotals:
    steps: int = 0
    tokens: int = 0
    requests: int = 0
    attended: int = 0
    decode_context: int = 0
    seconds: float = 0.0  # the model's forwards, on the clock
    cpu_seconds: float = 0.0  # the same, in the stepping thread's CPU time

    def add(self, shape: StepShape, seconds: float, cpu_seconds: float) -> None:
        self.steps += 1
        self.tokens += shape.tokens
        self.requests += shape.requests
        self.attended += shape.attended
        self.decode_context += shape.decode_context
        self.seconds += seconds
        self.cpu_seconds += cpu_seconds

    @classmethod
    def of(cls, fields: object) -> StepTotals:
        """From any object with these fields (the NodeStats proto's `steps`)."""
        return cls(*(getattr(fields, f) for f in _FIELDS))

    def since(self, earlier: StepTotals) -> StepTotals | None:
        """The steps run between `earlier` and these; None when these do not follow it (counted
        on another engine: a restarted node starts from zero)."""
        delta = StepTotals(*(getattr(self, f) - getattr(earlier, f) for f in _FIELDS))
        return None if any(getattr(delta, f) < 0 for f in _FIELDS) else delta

    def plus(self, other: StepTotals) -> StepTotals:
        return StepTotals(*(getattr(self, f) + getattr(other, f) for f in _FIELDS))

    def features(self) -> tuple[float, ...]:
        """The sums of every step's `StepShape.features()`."""
        return (float(self.steps), float(self.tokens), float(self.requests), float(self.attended),
                float(self.decode_context))


_FIELDS = StepTotals.__slots__

# (field, Prometheus series name after its prefix, help): how a node (`pdserve_<name>_total`) and
# the router (`pdserve_node_<name>_total{node, kind}`) export a node's `StepTotals`.
SERIES = (
    ("steps", "steps", "Engine steps run"),
    ("tokens", "step_tokens", "Tokens scheduled in the engine's steps"),
    ("requests", "step_requests", "Requests in the engine's steps, summed over the steps"),
    ("attended", "step_attended_pairs", "Query-key pairs the prompt chunks of the engine's steps attended"),
    ("decode_context", "step_decode_context_tokens", "KV tokens the decodes of the engine's steps read"),
    ("seconds", "step_seconds", "Seconds the model took in the engine's steps, on the clock"),
    ("cpu_seconds", "step_cpu_seconds", "Seconds of the stepping thread's CPU in the engine's steps"),
)
