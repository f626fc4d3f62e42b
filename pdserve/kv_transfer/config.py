"""Transfer-layer configuration.

Owns every address, port, timeout and size the KV transports use, with each default
in exactly one place. Must never read the environment or hold live state: a config is a
frozen value validated at construction.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field

PROGRESS_MODES = ("thread", "thread-polling", "blocking", "polling")
TRANSPORTS = ("ucx", "torch")  # pdserve/kv_transfer/ucx.py, pdserve/kv_transfer/torch_dist.py


@dataclass(frozen=True)
class KVTransferConfig:
    """Knobs shared by every transport; unused fields are ignored by the in-process one."""

    # Which transport moves the KV: UCX (host caches) or torch.distributed (gloo for host caches,
    # NCCL for CUDA ones). Prefill and decode nodes must agree: a decode node's layout names its
    # transport, and a prefill node on the other one is refused, naming it.
    transport: str = field(default="ucx", metadata={
        "choices": TRANSPORTS,
        "help": "ucx: UCX (host caches); torch: a torch.distributed process group per prefill/decode rank "
                "pair (gloo for host caches, NCCL for CUDA caches); every prefill and decode node the same"})

    # Address advertised to peers in the descriptor; UCX is kept to the interface that holds
    # it (netdev.py), the only one it listens on.
    host: str = "127.0.0.1"
    # The port UCX's TCP transport listens on (first transport of the process); 0: a free
    # one (the descriptor carries the real one).
    port: int = 0
    # Starting UCX in this process (first transport only).
    init_timeout_s: float = 30.0
    # Establishing the UCX endpoint (ucxx's peer-info exchange).
    connect_timeout_s: float = 5.0
    # torch transport: reaching a TCPStore (this rank's own, or a peer's). Longer than
    # connect_timeout_s because torch's store looks up the peer's name (a reverse DNS query,
    # getnameinfo) on every new connection, on both ends, and a resolver that drops the query
    # stalls it by its own timeout (glibc: 5 s): measured on the dev host, about one store
    # connection in 30 took 5 s.
    store_timeout_s: float = 30.0
    # torch transport: a peer's HELLO_REPLY, and both ranks joining a pair's groups (gloo's and
    # NCCL's own timeout). As long, because a store's one event loop stalls for as long on another
    # client's connect. A peer not there by then fails the connect (KVTransferError), never hangs it.
    rendezvous_timeout_s: float = 30.0
    # HELLO -> HELLO_REPLY round trip (fingerprint check) on first contact.
    handshake_timeout_s: float = 5.0
    # From push()/send_done() to the receiver's ack; past it the handle is FAILED and the
    # peer is treated as dead (its endpoints are aborted, later pushes fail at once).
    transfer_timeout_s: float = 30.0
    # Bound on closing endpoints / stopping the transport.
    close_timeout_s: float = 2.0
    # How often the watchdog looks for overdue transfers.
    watchdog_interval_s: float = 0.05
    # torch transport: how often the listener looks for a new peer's handshake on its store.
    accept_poll_s: float = 0.05
    # Largest control message (header + req_id + block ids + done payload).
    max_control_bytes: int = 1 << 20
    # Move KV bytes on a second UCX endpoint built from the peer's worker address without
    # peer-failure handling: that is what lets UCX pick shared memory on one host (11.8 MB
    # pushes, pdserve/bench/kv_transfer.py: 1.10 vs 0.69-0.83 GB/s one at a time, 1.54 vs 0.84-0.94
    # pipelined). Off by default, because such an endpoint cannot survive its peer's death:
    # a sender SIGKILLed mid-push aborts the receiving process when UCX was reading it with
    # CMA (process_vm_readv on a dead pid is fatal there), and without CMA it can leave the
    # receiver's shared-memory queue wedged for every other sender (its pushes time out).
    # tests/e2e/test_kv_transfer_ucx.py kills senders mid-push to check the default.
    # False: data rides the control endpoint, which keeps peer-failure handling (UCX picks TCP,
    # or CMA with its failures reported).
    fast_data_path: bool = False
    # Largest data message: a bigger push is cut on layer boundaries into messages of about
    # this size and pipelined (chunk j+1 is gathered and chunk j-1 scattered while chunk j
    # moves). Measured (pdserve/bench/kv_transfer.py shape, 11.8 MB pushes, loaded 2-core host):
    # median push->ack 7.4-8.1 ms at 2 MiB, 7.6-9.0 at 4 MiB, 8.6-9.3 at 1 MiB and
    # 9.2-10.2 ms as a single message.
    chunk_bytes: int = 2 << 20
    # ucxx progress mode. "thread" progresses UCX on its own thread, outside the GIL
    # (tiny push->ack median ~2 ms here); "blocking" measured ~12 ms (epoll wake-ups);
    # "polling" spins a core on the loop thread and starves the engine of the GIL.
    progress_mode: str = "thread"
    # UCX_TLS override, e.g. "tcp,self" (several hosts as network namespaces of one
    # machine); None keeps UCX's own choice.
    ucx_tls: str | None = None
    # Shared secret a connecting peer must present in its HELLO (and this side presents
    # when it connects); a receiver refuses any other HELLO before looking at its
    # fingerprint. None: no check. It crosses the network in the clear, like the bytes.
    auth_token: str | None = field(default=None, repr=False)
    # Receiving side: ask every sender to seal each push's data messages with their xxh3-64
    # digests, check them as they land, and refuse a request whose bytes do not match
    # (pdserve/kv_transfer/integrity.py). The receiver's choice, told to the sender in HELLO_REPLY.
    checksums: bool = True
    # Fault drill (a node's --debug-corrupt-kv-push): flip a byte of the Nth push this
    # transport sends after sealing it; 0: never.
    debug_corrupt_push: int = 0

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("KVTransferConfig.host must be a non-empty address")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"KVTransferConfig.port out of range: {self.port}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        for name in ("accept_poll_s", "init_timeout_s", "connect_timeout_s", "store_timeout_s", "rendezvous_timeout_s",
                     "handshake_timeout_s", "transfer_timeout_s", "close_timeout_s", "watchdog_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVTransferConfig.{name} must be > 0")
        if self.chunk_bytes <= 0:
            raise ValueError("KVTransferConfig.chunk_bytes must be > 0")
        if self.max_control_bytes < 4096:
            raise ValueError("KVTransferConfig.max_control_bytes must be >= 4096")
        if self.debug_corrupt_push < 0:
            raise ValueError(f"KVTransferConfig.debug_corrupt_push must be >= 0, got {self.debug_corrupt_push}")
        if self.progress_mode not in PROGRESS_MODES:
            raise ValueError(f"unknown progress_mode {self.progress_mode!r}; "
                             f"expected one of {PROGRESS_MODES}")

    def admits(self, presented: object) -> bool:
        """Whether a peer's HELLO, presenting `presented` as its `auth_token`, may connect: any
        peer when no token is set, else one presenting this token (compared in constant time)."""
        if self.auth_token is None:
            return True
        if not isinstance(presented, str):
            return False
        return hmac.compare_digest(presented.encode("utf-8", "replace"), self.auth_token.encode())

    def connect_budget_s(self) -> float:
        """The longest a `connect` on this transport may take before it fails."""
        if self.transport == "torch":  # the store, the handshake, then the pair's groups
            return self.store_timeout_s + 2 * self.rendezvous_timeout_s + self.close_timeout_s
        return self.connect_timeout_s + self.handshake_timeout_s + self.close_timeout_s
