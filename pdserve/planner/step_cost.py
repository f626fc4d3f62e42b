"""The step-time model: what one engine step costs, from the shape of the step alone.

One formula prices every step, prefill, decode or mixed, because the engine runs them as one
packed batch:

    time = base + per_token × tokens + per_seq × requests
                + per_attended × attended + per_decode_context × decode_context

`tokens` is the step's scheduled tokens (the rows every weight matrix multiplies), `requests`
the requests in it (per-request packing and sampling). Attention is priced apart for the two
ways the kernels run it: `attended` counts the query-key pairs of the prompt chunks (a chunk of
n tokens after c computed ones attends n·c + n(n+1)/2 pairs, compute-bound), `decode_context`
the tokens of KV each decode reads (c + 1 for a decode over c tokens, memory-bound). A
decode-only step of batch b and total context C is base + (per_token + per_seq)·b +
per_decode_context·(C + b); a prefill chunk grows with its tokens and, through `attended`, with
its context. The shape is the engine's (pdserve/engine/step_shape.py: the nodes sum it over their
steps, and `total` prices those sums).

Fitted by least squares with every coefficient kept ≥ 0 (a negative cost is noise). Pure: numbers
in, numbers out; never times anything itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pdserve.engine.step_shape import StepShape, StepTotals


@dataclass(frozen=True, slots=True)
class StepCost:
    base_s: float
    per_token_s: float
    per_seq_s: float
    per_attended_s: float
    per_decode_context_s: float

    def time(self, shape: StepShape) -> float:
        return (self.base_s + self.per_token_s * shape.tokens + self.per_seq_s * shape.requests
                + self.per_attended_s * shape.attended + self.per_decode_context_s * shape.decode_context)

    def total(self, steps: StepTotals) -> float:
        """The modelled seconds of every step summed in `steps`: the model is linear in a step's
        shape, so it prices the sums as it prices one step."""
        return (self.base_s * steps.steps + self.per_token_s * steps.tokens + self.per_seq_s * steps.requests
                + self.per_attended_s * steps.attended + self.per_decode_context_s * steps.decode_context)

    def scaled(self, factor: float) -> StepCost:
        """Every step `factor` times as long."""
        return StepCost(*(factor * c for c in (self.base_s, self.per_token_s, self.per_seq_s, self.per_attended_s,
                                               self.per_decode_context_s)))

    @classmethod
    def fit(cls, samples: list[tuple[StepShape, float]]) -> StepCost:
        """Non-negative least squares over (shape, seconds), relative to each sample's time, so a
        1 ms decode step weighs as much as a 300 ms prefill."""
        if not samples:
            raise ValueError("no step samples to fit")
        x = np.array([s.features() for s, _ in samples], dtype=np.float64)
        y = np.array([t for _, t in samples], dtype=np.float64)
        weights = 1.0 / np.maximum(y, 1e-9)
        scale = np.maximum(np.abs(x).max(axis=0), 1e-12)  # columns of one magnitude: a stable solve
        coef = _nonnegative_lstsq(x / scale * weights[:, None], y * weights) / scale
        return cls(*(float(c) for c in coef))

    def relative_error(self, samples: list[tuple[StepShape, float]]) -> float:
        """Root mean square of (modelled − measured) / measured."""
        errors = [(self.time(s) - t) / t for s, t in samples if t > 0]
        return float(np.sqrt(np.mean(np.square(errors)))) if errors else 0.0


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with x ≥ 0: drop the most negative coefficient (fix it at 0) and solve again
    until none is negative. Five columns at most, so this active-set loop ends in five solves."""
    active = list(range(a.shape[1]))
    while True:
        coef = np.zeros(a.shape[1])
        if active:
            coef[active] = np.linalg.lstsq(a[:, active], b, rcond=None)[0]
        negative = [i for i in active if coef[i] < 0]
        if not negative:
            return coef
        active.remove(min(negative, key=lambda i: coef[i]))
