"""Router configuration: every address, timeout and size of the router, with its default in one place.

Owns `RouterConfig` and the `host:port` parsing the router's flags use. It never opens
a socket and never reads the model directory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.config import DEFAULT_BLOCK_SIZE
from pdserve.common.lifecycle import DEFAULT_DRAIN_TIMEOUT_S
from pdserve.common.tls import TlsConfig

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50051
# gRPC's own default: a request message larger than this is refused by gRPC with
# RESOURCE_EXHAUSTED before the router reads it.
DEFAULT_MAX_MESSAGE_BYTES = 4 << 20


@dataclass(frozen=True)
class AdmissionLimits:
    """The router's bounds (part of `RouterConfig`; each a `pdserve router` flag)."""

    max_inflight_requests: int = field(default=256, metadata={
        "help": "sequences in flight (a request with n samples counts n); beyond: RESOURCE_EXHAUSTED"})
    # Queued tokens: prompt tokens admitted but not yet at token 1 — the prefill work a new
    # request waits behind, so what bounds its time to first token.
    max_queued_tokens: int = field(default=65536, metadata={
        "help": "prompt tokens admitted but not yet at token 1; beyond: RESOURCE_EXHAUSTED"})

    def __post_init__(self) -> None:
        for name in ("max_inflight_requests", "max_queued_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class RequestLimits:
    """What one GenerateRequest may hold beyond what the model and the KV pools allow."""

    # None: the model's max_model_len - 1 (the longest prompt that can still generate).
    max_prompt_tokens: int | None = field(default=None, metadata={
        "help": "longest prompt accepted, in tokens (default: the model's length - 1)"})
    # Checked before tokenizing, so a huge text costs no tokenizer time (tokenizing
    # 256 Ki characters takes ~0.3 s of the router's loop on a slow core).
    max_prompt_chars: int = field(default=1 << 18, metadata={
        "help": "longest text prompt accepted, in characters, checked before tokenizing"})
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = 256
    max_request_id_chars: int = 256

    def __post_init__(self) -> None:
        for name in ("max_prompt_chars", "max_stop_strings", "max_stop_string_chars", "max_stop_token_ids",
                     "max_request_id_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")


@dataclass(frozen=True)
class RouterConfig:
    model: str = field(metadata={"help": "model directory (tokenizer + config only)"})
    host: str = DEFAULT_HOST
    port: int = field(default=DEFAULT_PORT, metadata={"help": "0: the OS picks (printed on start)"})
    # The OpenAI-compatible HTTP API on `host` (None: off; 0: the OS picks, printed on start).
    http_port: int | None = field(default=None, metadata={
        "help": "serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, ...) on --host at "
                "this port (0: the OS picks); off by default"})
    served_model_name: str | None = field(default=None, metadata={
        "help": "the model's name in the HTTP API (default: the model folder's name)"})
    chat_template: str | None = field(default=None, metadata={
        "help": "a Jinja chat template FILE for /v1/chat/completions, instead of the tokenizer's own"})
    # Prometheus /metrics on `host` (None: off; 0: the OS picks, printed on start).
    metrics_port: int | None = field(default=None, metadata={
        "help": "serve Prometheus /metrics on --host at this port (0: the OS picks); off by default"})
    # Static node addresses (polled with GetStats); nodes may also register themselves.
    # (--prefill / --decode HOST:PORT, repeatable)
    prefill_addresses: tuple[str, ...] = field(default=(), metadata={"flag": False})
    decode_addresses: tuple[str, ...] = field(default=(), metadata={"flag": False})
    # A node silent (no heartbeat, no answered GetStats) this long is dropped.
    # Ten missed heartbeats (nodes send one every 0.5 s): a node whose front is starved
    # of CPU by its own engine core on a small machine is slow, not dead.
    heartbeat_timeout_s: float = 5.0
    # Told to nodes when they register.
    heartbeat_interval_ms: int = 500
    # How often the registry drops silent nodes and polls static ones.
    maintenance_interval_s: float = 0.25
    stats_poll_timeout_s: float = 1.0
    # Must match the nodes' block size: prefix-affinity hashes whole blocks.
    block_size: int = field(default=DEFAULT_BLOCK_SIZE, metadata={"help": "the nodes' KV block size"})
    # A prefill node holding the prompt's prefix wins while its queue is at most this
    # many tokens longer than the shortest queue.
    affinity_slack_tokens: int = 2048
    max_affinity_entries: int = 1 << 16
    # A decode node that refused for lack of blocks is skipped until its next stats,
    # or this long at most.
    exhausted_cooldown_s: float = 1.0
    # Node calls: how long a decode node may take to reserve, a prefill node to answer.
    ready_timeout_s: float = 30.0
    prefill_timeout_s: float = 600.0
    # After a decode stream's last event, how long to wait for its end before cancelling.
    stream_end_grace_s: float = 1.0
    # Node failures (pdserve/router/dispatch/driver.py): a sample whose decode (or colocated) node is lost
    # while it streams resumes on another one at most this many times; one whose node is
    # lost before its next token (a prefill node, or the decode node it was prefilling
    # into) is retried at most this many times. A node that failed a call gets a GetStats
    # probe bounded by failure_probe_timeout_s; if it does not answer it is suspect
    # (skipped) until it does.
    max_resumes: int = 2
    max_prefill_retries: int = 2
    # Decode nodes with --local-prefill (pdserve/router/dispatch/hybrid.py): where each request's prompt is computed.
    disaggregation: str = field(default="auto", metadata={
        "choices": ("always", "never", "auto"),
        "help": "with decode nodes started --local-prefill: always prefill on the prefill pool, never (on the "
                "decode node itself), or auto: on the decode node when its share is small or the pool is "
                "further behind; without such nodes every request is disaggregated"})
    local_prefill_max_tokens: int = field(default=256, metadata={
        "help": "--disaggregation auto: prompt tokens a decode node may have to compute before a request's "
                "first token (its queue and the prompt) for the request to be prefilled there"})
    local_prefill_tokens_per_s: float | None = field(default=None, metadata={
        "help": "--disaggregation auto: prompt tokens a second each decode node may compute for itself, over "
                "any few seconds (what a TPOT target leaves it: pdserve plan derives it); unset: no such bound"})
    stream_interval: int = field(default=1, metadata={
        "help": "tokens per streamed response: a decode or colocated node holds a sample's tokens until this many "
                "are ready (its first and last go at once), so the router relays one response per this many "
                "tokens; 1 streams every token. Larger costs the router less CPU per token and gives the client "
                "its text in bursts"})
    # A query of death: a request whose node attempts failed this many times in all (nodes lost,
    # or a node's step raising on it) ends INTERNAL instead of going to the next node.
    max_node_failures_per_request: int = field(default=3, metadata={
        "help": "end a request INTERNAL once this many of its node attempts have failed (resumes and retries "
                "together), instead of sending it on to kill the next node"})
    failure_probe_timeout_s: float = 1.0
    max_n: int = 64
    limits: RequestLimits = field(default_factory=RequestLimits)
    max_message_bytes: int = field(default=DEFAULT_MAX_MESSAGE_BYTES, metadata={
        "help": "largest request message; gRPC refuses a larger one with RESOURCE_EXHAUSTED"})
    # The node join credential callers must present (pdserve/common/auth.py); None: no authentication.
    auth_token: str | None = field(default=None, repr=False, metadata={"flag": False})
    # TLS (pdserve/common/tls.py): mutual on the gRPC port (the Registry is there: a node must present a
    # certificate the CA signed, and so must a gRPC client), server-only on the HTTP front (API keys
    # authenticate its callers); also on the channels to the nodes. None: plaintext.
    tls: TlsConfig | None = field(default=None, metadata={"flag": False})
    # Client API keys (pdserve/common/api_keys.py): they open the public API, never the Registry.
    api_keys_file: str | None = field(default=None, metadata={
        "metavar": "PATH", "help": "client API keys, one a line, reloaded when the file changes: each opens the "
                                   "public API (gRPC and HTTP) but not node registration; needs --auth-token-file"})
    # Admission (pdserve/router/requests/admission.py): beyond these the router refuses at once with
    # RESOURCE_EXHAUSTED instead of queueing.
    admission: AdmissionLimits = field(default_factory=AdmissionLimits)
    shutdown_grace_s: float = 5.0
    drain_timeout_s: float = field(default=DEFAULT_DRAIN_TIMEOUT_S, metadata={
        "help": "on SIGTERM: refuse new requests (UNAVAILABLE, HTTP 503) and give the ones in flight this long "
                "to finish before stopping"})
    # How long in-flight calls on a dropped node's channel may finish before it closes.
    channel_close_grace_s: float = 5.0

    def __post_init__(self) -> None:
        for address in (*self.prefill_addresses, *self.decode_addresses):
            parse_address(address)
        checks = [
            (0 <= self.port <= 65535, "port", "must be in [0, 65535]", self.port),
            (self.http_port is None or 0 <= self.http_port <= 65535, "http_port", "must be in [0, 65535]",
             self.http_port),
            (self.metrics_port is None or 0 <= self.metrics_port <= 65535, "metrics_port",
             "must be in [0, 65535]", self.metrics_port),
            (self.heartbeat_timeout_s > 0, "heartbeat_timeout_s", "must be > 0", self.heartbeat_timeout_s),
            (self.heartbeat_interval_ms > 0, "heartbeat_interval_ms", "must be > 0", self.heartbeat_interval_ms),
            (self.block_size >= 1, "block_size", "must be >= 1", self.block_size),
            (self.affinity_slack_tokens >= 0, "affinity_slack_tokens", "must be >= 0", self.affinity_slack_tokens),
            (self.max_n >= 1, "max_n", "must be >= 1", self.max_n),
            (self.stream_interval >= 1, "stream_interval", "must be >= 1", self.stream_interval),
            (self.max_resumes >= 0, "max_resumes", "must be >= 0", self.max_resumes),
            (self.max_prefill_retries >= 0, "max_prefill_retries", "must be >= 0", self.max_prefill_retries),
            (self.disaggregation in ("always", "never", "auto"), "disaggregation", "must be always, never or auto",
             self.disaggregation),
            (self.local_prefill_max_tokens >= 0, "local_prefill_max_tokens", "must be >= 0",
             self.local_prefill_max_tokens),
            (self.local_prefill_tokens_per_s is None or self.local_prefill_tokens_per_s > 0,
             "local_prefill_tokens_per_s", "must be > 0", self.local_prefill_tokens_per_s),
            (self.max_node_failures_per_request >= 1, "max_node_failures_per_request", "must be >= 1",
             self.max_node_failures_per_request),
            (self.drain_timeout_s >= 0, "drain_timeout_s", "must be >= 0", self.drain_timeout_s),
            (self.failure_probe_timeout_s > 0, "failure_probe_timeout_s", "must be > 0",
             self.failure_probe_timeout_s),
            (self.max_message_bytes >= 1024, "max_message_bytes", "must be >= 1024", self.max_message_bytes),
        ]
        for ok, name, rule, value in checks:
            if not ok:
                raise ValueError(f"{name} {rule}, got {value}")
        if self.api_keys_file is not None and self.auth_token is None:
            # Without a node credential the Registry would take anyone, a key holder included.
            raise ValueError("--api-keys-file needs the node join credential (--auth-token-file or "
                             "$PDSERVE_AUTH_TOKEN): without it anyone could register a node")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def parse_address(address: str) -> tuple[str, int]:
    """'host:port' → (host, port); ValueError naming the address otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"address must be HOST:PORT with a port in [1, 65535], got {address!r}")
    return host, int(port)

