"""The done message a prefill node sends a decode node after a request's KV.

It rides the KV transport's completion channel (`send_done`), behind the request's
pushes, so the decode node reads it only after every byte before it has landed. JSON:

    {"status": "ok", "token_id": 123, "logprobs": {...} | null, "parts": 2}   token 1, sampled by P
    {"status": "aborted"}                                                      P gave up: nothing more lands
    {"status": "renew"}                         P still holds the request (queued, computing, pushing):
                                                the decode node's lease runs afresh (pdserve/node/core/lease.py)

Between tensor-parallel nodes each rank pair (route, pdserve/ranks/kv_ranks.py) carries its own copy,
behind that pair's pushes; `parts` is how many copies the decode node collects before the
request's KV is whole on every one of its ranks.

Must never: pickle, or carry anything a decode node could mistake for KV.
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass

from pdserve.node.messages import Logprobs


class DoneStatus(enum.Enum):
    OK = "ok"
    ABORTED = "aborted"
    RENEW = "renew"


@dataclass(slots=True)
class KVDone:
    status: DoneStatus
    token_id: int = -1  # token 1 when status is OK
    logprobs: Logprobs | None = None
    parts: int = 1  # copies of this message one request sends (one per rank pair)

    def to_bytes(self) -> bytes:
        body = {"status": self.status.value}
        if self.status is DoneStatus.OK:
            body.update(token_id=self.token_id, logprobs=asdict(self.logprobs) if self.logprobs else None,
                        parts=self.parts)
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> KVDone:
        """Raises ValueError on anything but a well-formed done message."""
        try:
            body = json.loads(raw)
            status = DoneStatus(body["status"])
            if status is not DoneStatus.OK:
                return cls(status)
            logprobs = body.get("logprobs")
            parts = int(body.get("parts", 1))
            if parts < 1:
                raise ValueError(f"parts must be >= 1, got {parts}")
            return cls(status, int(body["token_id"]), Logprobs(**logprobs) if logprobs else None, parts)
        except (KeyError, TypeError, ValueError, json.JSONDecodeError) as exc:
            raise ValueError(f"malformed KV done message: {exc!r}") from exc
