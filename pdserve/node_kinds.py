"""The node kinds, one row each: a node is the node core (pdserve/node/core/node_core.py) plus the KV stages
its kind adds, serving its kind's gRPC services (pdserve/node/front/server.py runs any row). A decode
node's flags add options to its row.

| kind      | scheduling policy              | KV stages                    | its own prompts   | services                    |
| --------- | ------------------------------ | ---------------------------- | ----------------- | --------------------------- |
| prefill   | PrefillPolicy (hand off at 1)  | export (prefill_node/)       | no                | PrefillNode                 |
| decode    | ColocatedPolicy                | import (decode_node/)        | no                | DecodeNode                  |
|  --local-prefill                           | (+ none)                     | yes               | + ColocatedNode             |
|  --serve-prefill                           | + export                     | yes               | + ColocatedNode, PrefillNode |
| colocated | ColocatedPolicy                | none                         | yes               | ColocatedNode               |

A decode node with `--local-prefill` is a hybrid: the router may send it a request's prompt
(`Generate`, as to a colocated node) or only its decode (`Decode`, the KV from a prefill node).
With `--serve-prefill` it is also a prefill node for the other decode nodes (`Prefill`: the prompt
leaves its engine at token 1, `Request.hands_off`, and its KV is exported): a pool of such nodes
is colocated and disaggregated at once, and the router picks per request (pdserve/router/dispatch/hybrid.py).
`pdserve prefill|decode|colocated` run `main` of this module with their kind.

Must never: hold logic of its own; a kind is data.
"""

from __future__ import annotations

from pdserve.engine.policy import ColocatedPolicy
from pdserve.node.front.server import NodeKind, NodeOption, run_node
from pdserve.node.front.servicers import StreamServicer
from pdserve.prefill_node.policy import PrefillPolicy
from pdserve.prefill_node.server import PrefillServicer

EXPORT = "pdserve.prefill_node.kv_export:make_stage"
IMPORT = "pdserve.decode_node.kv_import:make_stage"

KINDS = {
    "prefill": NodeKind("prefill", PrefillPolicy, (EXPORT,), own_prompts=False,
                        services={"PrefillNode": PrefillServicer}),
    "decode": NodeKind("decode", ColocatedPolicy, (IMPORT,), own_prompts=False, services={"DecodeNode": StreamServicer},
                       options=(NodeOption("local_prefill", services={"ColocatedNode": StreamServicer}, own_prompts=True),
                                NodeOption("serve_prefill", (EXPORT,), own_prompts=True,
                                           services={"ColocatedNode": StreamServicer, "PrefillNode": PrefillServicer}))),
    "colocated": NodeKind("colocated", ColocatedPolicy, (), own_prompts=True,
                          services={"ColocatedNode": StreamServicer}),
}


def main(kind: str, argv: list[str] | None = None) -> int:
    return run_node(argv, KINDS[kind])
