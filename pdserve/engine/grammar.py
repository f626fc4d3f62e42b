"""Constrained decoding in one engine: compiled grammars, per-request matchers, the step's mask.

`GrammarCompiler` compiles a `StructuredOutput` for this engine's tokenizer on a thread of its
own, never in the step loop, and keeps each compiled grammar (by its spec) for the next request
that asks for it. `RequestGrammar` is one sample's matcher state: made by replaying the grammar
over the tokens the sample already has — nothing, a prefill node's token 1, the tokens a failed
node streamed before a resume, a parent's tokens for a fork — so any engine continues any sample
exactly where another left off. `GrammarGate` holds a request out of the scheduler until its
grammar is compiled. `mask_logits` applies the constrained rows' next-token masks in the sampler.

An engine that never sees a constraint never builds a compiler nor imports xgrammar.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pdserve.engine.structured_output import StructuredOutput, grammar_of

if TYPE_CHECKING:
    from pdserve.engine.request import Request

logger = logging.getLogger(__name__)

# Compiled grammars kept per engine (by spec); a compiled JSON schema is tens of KiB.
MAX_CACHED_GRAMMARS = 256


class GrammarCompiler:
    """Compiles specs for one tokenizer off the caller's thread; each spec once while it is cached."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 max_cached: int = MAX_CACHED_GRAMMARS) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._compiler: Any = None  # built on the compile thread, on first use
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[StructuredOutput, Future] = OrderedDict()
        self._max_cached = max_cached

    def compile(self, structured: StructuredOutput) -> Future:
        """A future of the compiled grammar (done at once when cached)."""
        future = self._cache.get(structured)
        if future is not None:
            self._cache.move_to_end(structured)
            return future
        future = self._pool.submit(self._compile, structured)
        self._cache[structured] = future
        if len(self._cache) > self._max_cached:
            self._cache.popitem(last=False)
        return future

    def _compile(self, structured: StructuredOutput) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                      stop_token_ids=self._eos_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler.compile_grammar(grammar_of(structured))


@dataclass(slots=True, eq=False)
class RequestGrammar:
    """One sample's position in its grammar."""

    compiled: Any  # xgrammar.CompiledGrammar
    matcher: Any  # xgrammar.GrammarMatcher

    @classmethod
    def start(cls, compiled: Any, token_ids: Sequence[int]) -> RequestGrammar:
        """The matcher after `token_ids`, the sample's output so far."""
        import xgrammar as xgr

        grammar = cls(compiled, xgr.GrammarMatcher(compiled))
        for t in token_ids:
            grammar.accept(t)
        return grammar

    def accept(self, token_id: int) -> None:
        if not self.matcher.accept_token(token_id):
            # Only a token sampled under another mask gets here (a bug); the sample goes on unconstrained
            # by it rather than failing, and says so.
            logger.error("grammar refused token %d it should have allowed", token_id)

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()


def mask_logits(logits: torch.Tensor, grammars: Sequence[RequestGrammar | None]) -> None:
    """Mask to -inf, in place, every token row r's grammar does not allow next. logits: [rows, vocab] float32."""
    idx = [r for r, g in enumerate(grammars) if g is not None]
    if not idx:
        return
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(grammars), logits.shape[1])  # [rows, ceil(vocab / 32)] int32
    for r in idx:
        grammars[r].matcher.fill_next_token_bitmask(bitmask, r)
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=idx)


class GrammarGate:
    """Requests whose grammar is still compiling, held out of the scheduler until it is ready."""

    def __init__(self, make_compiler: Callable[[], GrammarCompiler]) -> None:
        self._make_compiler = make_compiler
        self._compiler: GrammarCompiler | None = None
        self._pending: dict[str, Future] = {}  # req_id -> its compile, for requests not yet attached
        self._held: dict[str, Request] = {}  # of those, the ones waiting here instead of the scheduler

    def start(self, request: Request) -> None:
        """Start compiling `request`'s grammar (a no-op for an unconstrained one)."""
        structured = request.params.structured_output
        if structured is None or request.grammar is not None:
            return
        if self._compiler is None:
            self._compiler = self._make_compiler()
        self._pending[request.req_id] = self._compiler.compile(structured)

    def attach_if_ready(self, request: Request) -> bool:
        """True when `request` may be scheduled: unconstrained, or its matcher attached now or before."""
        if request.params.structured_output is None or request.grammar is not None:
            return True
        if request.req_id not in self._pending:
            self.start(request)
        future = self._pending[request.req_id]
        if not future.done() or future.exception() is not None:
            return False
        del self._pending[request.req_id]
        request.grammar = RequestGrammar.start(future.result(), request.output_token_ids)
        return True

    def hold(self, request: Request) -> None:
        self._held[request.req_id] = request

    def release(self, request: Request) -> None:
        """Stop holding `request` (paused): its compile goes on, nothing schedules it from here."""
        self._held.pop(request.req_id, None)

    def ready(self) -> tuple[list[Request], list[tuple[Request, BaseException]]]:
        """Held requests now attached (to schedule), and those whose compile failed (to fail)."""
        ready, failed = [], []
        for req_id, request in list(self._held.items()):
            future = self._pending[req_id]
            if not future.done():
                continue
            del self._held[req_id]
            if future.exception() is not None:
                del self._pending[req_id]
                failed.append((request, future.exception()))
                continue
            self.attach_if_ready(request)
            ready.append(request)
        return ready, failed

    def wait(self, timeout_s: float) -> None:
        """Block until a held request's compile ends, at most `timeout_s` (nothing else can run)."""
        futures = [self._pending[req_id] for req_id in self._held]
        if futures:
            wait(futures, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def remove(self, request: Request) -> None:
        self._pending.pop(request.req_id, None)
        self._held.pop(request.req_id, None)

    def __len__(self) -> int:
        return len(self._held)
