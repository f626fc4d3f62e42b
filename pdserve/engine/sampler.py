"""One step's logits in, one token per row out, vectorised over the batch.

The sampler owns the per-step pipeline, in vLLM v1's order: logprobs from the raw
logits; min_tokens masking of eos and stop ids; repetition, then frequency and
presence penalties; the grammar's mask of a constrained row (pdserve/engine/grammar.py); then greedy rows take the argmax and the others go through
temperature, top-k, top-p, min-p and a random draw. Work no row asks for is skipped.

The draw of a row depends only on (seed, sample_index, position): one uniform number
from a CPU generator seeded with a hash of those integers, mapped through the row's
cumulative distribution (inverse CDF). One draw per row rather than noise per
vocabulary entry keeps the step cheap on a CPU. So a request samples the same
tokens whatever batch it shares, whichever row it sits in, and whichever node (the
prefill or the decode one) samples it. The sampler keeps no state between steps and
never decides when a sequence stops.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.grammar import RequestGrammar, mask_logits
from pdserve.engine.sampling_params import SamplingParams

# Dividing float32 logits by a smaller temperature overflows them to inf; at this
# temperature the distribution is already one-hot for any realistic logit gap.
MIN_TEMPERATURE = 1e-5
_MASK63 = (1 << 63) - 1  # torch generator seeds are signed 64-bit
_MASK64 = 0xFFFFFFFFFFFFFFFF


@dataclass(slots=True)
class SamplingRow:
    """One row of logits to sample."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # tokens generated so far by this sequence
    seed: int  # always set: the engine draws one for unseeded requests
    sample_index: int = 0  # which of the n samples of a request (0..n-1)
    grammar: RequestGrammar | None = None  # a constrained row's matcher: only the tokens it allows are drawn


@dataclass(slots=True)
class TokenLogprobs:
    token_logprob: float  # of the sampled token
    top_token_ids: list[int]  # params.logprobs of them, most likely first
    top_logprobs: list[float]


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprobs | None]  # None where params.logprobs is None


class Sampler:
    def __init__(self, eos_token_ids: Sequence[int]):
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        # logits: [num_rows, vocab], any float dtype
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
        if not rows:
            return SamplerOutput(token_ids=[], logprobs=[])
        logprob_rows = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        raw_logprobs = _raw_logprobs(logits, logprob_rows)  # [len(logprob_rows), vocab]
        token_ids = _sample(self.process_logits(logits, rows), rows)  # [num_rows] int64
        logprobs = _gather_logprobs(raw_logprobs, logprob_rows, rows, token_ids)
        # The step's one copy back to the host: the sampled ids the engine core records.
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprobs)

    def process_logits(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """A float32 copy of `logits` with min_tokens masking and the penalties applied:
        what greedy rows take the argmax of and the others scale by temperature."""
        logits = logits.to(torch.float32, copy=True)  # [num_rows, vocab], edited in place
        self._mask_min_tokens(logits, rows)
        _apply_repetition_penalty(logits, rows)
        _apply_frequency_presence_penalties(logits, rows)
        mask_logits(logits, [row.grammar for row in rows])
        return logits

    def _banned_ids(self, row: SamplingRow) -> set[int]:
        """Token ids that would end the sequence before it has min_tokens."""
        if len(row.output_token_ids) >= row.params.min_tokens:
            return set()
        banned = set(row.params.stop_token_ids)
        if not row.params.ignore_eos:  # with ignore_eos eos ends nothing, so needs no mask
            banned.update(self.eos_token_ids)
        return banned

    def _mask_min_tokens(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        vocab = logits.shape[1]
        row_idx: list[int] = []
        token_idx: list[int] = []
        for i, row in enumerate(rows):
            banned = [t for t in self._banned_ids(row) if t < vocab]
            row_idx.extend([i] * len(banned))
            token_idx.extend(banned)
        if row_idx:
            logits[_index(row_idx, logits.device), _index(token_idx, logits.device)] = float("-inf")


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)  # [n, 1]


def _raw_logprobs(logits: torch.Tensor, row_idx: list[int]) -> torch.Tensor | None:
    if not row_idx:
        return None
    return log_softmax_rows(logits[_index(row_idx, logits.device)])


def _token_counts(per_row: list[list[Sequence[int]]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(per_row), vocab] float32: how often each token occurs in each row's sequences."""
    parts = [torch.as_tensor(seq, dtype=torch.int64) for seqs in per_row for seq in seqs]
    lengths = torch.tensor([sum(len(seq) for seq in seqs) for seqs in per_row], dtype=torch.int64)
    row_idx = torch.repeat_interleave(torch.arange(len(per_row)), lengths).to(device)
    token_idx = torch.cat(parts).to(device)
    counts = torch.zeros(len(per_row), vocab, dtype=torch.float32, device=device)
    counts.index_put_((row_idx, token_idx), torch.ones_like(token_idx, dtype=torch.float32), accumulate=True)
    return counts


def _apply_repetition_penalty(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    idx = [i for i, row in enumerate(rows) if row.params.repetition_penalty != 1.0]
    if not idx:
        return
    per_row = [[rows[i].prompt_token_ids, rows[i].output_token_ids] for i in idx]
    seen = _token_counts(per_row, logits.shape[1], logits.device) > 0  # [len(idx), vocab]
    penalty = _column([rows[i].params.repetition_penalty for i in idx], logits.device)
    idx_t = _index(idx, logits.device)
    sub = logits[idx_t]
    penalised = torch.where(sub > 0, sub / penalty, sub * penalty)
    logits[idx_t] = torch.where(seen, penalised, sub)


def _apply_frequency_presence_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    idx = [
        i
        for i, row in enumerate(rows)
        if row.params.frequency_penalty != 0.0 or row.params.presence_penalty != 0.0
    ]
    if not idx:
        return
    counts = _token_counts([[rows[i].output_token_ids] for i in idx], logits.shape[1], logits.device)
    frequency = _column([rows[i].params.frequency_penalty for i in idx], logits.device)
    presence = _column([rows[i].params.presence_penalty for i in idx], logits.device)
    idx_t = _index(idx, logits.device)
    logits[idx_t] -= frequency * counts + presence * (counts > 0).to(torch.float32)


def _sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """[num_rows] int64 token ids; greedy rows argmax, the rest draw."""
    random_idx = [i for i, row in enumerate(rows) if not row.params.greedy]
    if len(random_idx) < len(rows):
        token_ids = logits.argmax(dim=-1)
    else:
        token_ids = torch.empty(len(rows), dtype=torch.int64, device=logits.device)
    if not random_idx:
        return token_ids
    random_rows = [rows[i] for i in random_idx]
    idx_t = _index(random_idx, logits.device)
    probs = _truncated_probs(logits[idx_t], [row.params for row in random_rows])
    # Inverse CDF: one uniform draw per row picks token i with probability p_i / sum(p).
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)  # [n, vocab]
    u = row_uniforms([row_key(row) for row in random_rows]).to(cdf.device)
    targets = (u * cdf[:, -1]).unsqueeze(1)
    drawn = torch.searchsorted(cdf, targets, right=True).squeeze(1)
    if bool((drawn >= probs.shape[1]).any()):
        # u * total rounded up to total: take the last token that has mass.
        last = probs.shape[1] - 1 - (probs > 0).flip(-1).int().argmax(dim=-1)
        drawn = torch.minimum(drawn, last)
    token_ids[idx_t] = drawn
    return token_ids


def _truncated_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p applied; [n, vocab] unnormalised probs."""
    temperatures = [max(p.temperature, MIN_TEMPERATURE) for p in params]
    if any(t != 1.0 for t in temperatures):
        logits.div_(_column(temperatures, logits.device))
    _apply_top_k_top_p(logits, [p.top_k for p in params], [p.top_p for p in params])
    probs = logits.softmax(dim=-1)
    min_p = [p.min_p for p in params]
    if any(m > 0.0 for m in min_p):
        # Ratio to the most likely token, so it reads the same before or after renormalising.
        threshold = _column(min_p, probs.device) * probs.amax(dim=-1, keepdim=True)
        probs.masked_fill_(probs < threshold, 0.0)
    return probs


def _apply_top_k_top_p(logits: torch.Tensor, top_k: list[int | None], top_p: list[float]) -> None:
    """Mask to -inf every logit below its row's top-k, then top-p, cutoff value.

    Only rows that truncate are touched, and only a batch with a top-p row pays for a
    full sort. Cutoffs are values, so tokens tied with the last kept one stay.
    """
    vocab = logits.shape[1]
    ks = [vocab if k is None else min(k, vocab) for k in top_k]
    idx = [i for i, (k, p) in enumerate(zip(ks, top_p)) if k < vocab or p < 1.0]
    if not idx:
        return
    idx_t = _index(idx, logits.device)
    sub = logits[idx_t]  # [len(idx), vocab]
    ks = [ks[i] for i in idx]
    # p == 1 keeps everything: rounding can push the cumulative sum past 1 in the tail.
    ps = [float("inf") if top_p[i] >= 1.0 else top_p[i] for i in idx]
    use_top_p = any(p < 1.0 for p in ps)
    if use_top_p:
        ranked = sub.sort(dim=-1, descending=True).values  # [len(idx), vocab]
    else:
        ranked = sub.topk(max(ks), dim=-1).values  # [len(idx), max(ks)], descending
    kth = ranked.gather(1, _index([k - 1 for k in ks], logits.device).unsqueeze(1))  # [len(idx), 1]
    sub.masked_fill_(sub < kth, float("-inf"))
    if use_top_p:
        ranked.masked_fill_(ranked < kth, float("-inf"))
        sub.masked_fill_(sub < _top_p_cutoff(ranked, _column(ps, logits.device)), float("-inf"))
    logits[idx_t] = sub


def _top_p_cutoff(ranked: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[n, 1] smallest logit of the shortest prefix of `ranked` holding top_p of the mass."""
    probs = ranked.softmax(dim=-1)  # [n, vocab], descending
    mass_before = probs.cumsum(dim=-1) - probs  # non-decreasing, so the kept set is a prefix
    num_kept = (mass_before < top_p).sum(dim=-1, keepdim=True).clamp_min(1)  # [n, 1]
    return ranked.gather(1, num_kept - 1)


def _gather_logprobs(
    raw_logprobs: torch.Tensor | None,
    row_idx: list[int],
    rows: Sequence[SamplingRow],
    token_ids: torch.Tensor,
) -> list[TokenLogprobs | None]:
    out: list[TokenLogprobs | None] = [None] * len(rows)
    if raw_logprobs is None:
        return out
    idx_t = _index(row_idx, raw_logprobs.device)
    gathered = token_logprobs(raw_logprobs, token_ids[idx_t], [rows[i].params.logprobs for i in row_idx])
    for i, lp in zip(row_idx, gathered):
        out[i] = lp
    return out


def token_logprobs(raw_logprobs: torch.Tensor, token_ids: torch.Tensor, num_tops: list[int]) -> list[TokenLogprobs]:
    """Row r: the logprob of `token_ids[r]` and the `num_tops[r]` most likely tokens.

    raw_logprobs: [n, vocab] float32 log-softmax of raw logits; token_ids: [n] int64. Also
    what scores prompt tokens (pdserve/engine/prompt_logprobs.py), so both read the same numbers.
    """
    assert raw_logprobs.shape[0] == token_ids.shape[0] == len(num_tops)
    chosen = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()
    num_top = min(max(num_tops, default=0), raw_logprobs.shape[1])
    top_values, top_ids = raw_logprobs.topk(num_top, dim=-1)
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    return [TokenLogprobs(chosen[r], top_ids[r][:n], top_values[r][:n]) for r, n in enumerate(num_tops)]


def log_softmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """[n, vocab] float32 log-softmax of every row of `logits` (no penalty or temperature)."""
    return logits.to(torch.float32).log_softmax(dim=-1)


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection on 64-bit ints with full avalanche."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def row_key(row: SamplingRow) -> int:
    """64-bit noise key of a row: a function of (seed, sample_index, position) only."""
    key = _mix64(row.seed & _MASK64)
    key = _mix64(key ^ (row.sample_index & _MASK64))
    return _mix64(key ^ len(row.output_token_ids))


def row_uniforms(keys: list[int]) -> torch.Tensor:
    """[len(keys)] float64 uniforms in [0, 1); entry r depends only on keys[r].

    Each comes from a CPU generator seeded with its key, so every node and device
    draws the same number for the same (seed, sample_index, position).
    """
    generator = torch.Generator()
    out = torch.empty(len(keys), dtype=torch.float64)
    for r, key in enumerate(keys):
        generator.manual_seed(key & _MASK63)
        out[r] = torch.rand(1, dtype=torch.float64, generator=generator)
    return out
