"""pdserve: disaggregated prefill/decode serving for transformer LLMs.

`LLM` and `SamplingParams` are re-exported lazily, so importing one submodule
(say `pdserve.engine.block_pool`) does not load torch and transformers.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "pdserve.llm",
    "RequestOutput": "pdserve.llm",
    "CompletionOutput": "pdserve.llm",
    "SamplingParams": "pdserve.engine.sampling_params",
    "StructuredOutput": "pdserve.engine.structured_output",
    "BeamSearchParams": "pdserve.engine.beam_search",
    "BeamSearchOutput": "pdserve.llm",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
