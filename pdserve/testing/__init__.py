"""The one test harness, shared by the tests and the benchmarks: fake nodes, the router
in-process, and the one way to wait for a condition.

    waiting.py         `until` (async) and `wait_until` (sync): a bounded poll, never a bare sleep
    fake_nodes.py      scripted fake prefill and decode servicers (`Script`, `Calls`)
    fake_colocated.py  a fake colocated servicer (both phases: tokens, beams, refusals, a death)
    node_server.py     `FakeNode`: a fake's real gRPC server on 127.0.0.1, its registration and
                       heartbeats; `fake_nodes` and `colocated_nodes` start a set and always stop it
    router.py          the real router server in-process, a bounded event loop, a collecting client
    metrics.py         a /metrics endpoint read back: a counter's or gauge's samples by a label
    serve_fakes.py     `python -m pdserve.testing.serve_fakes`: fake nodes that answer at once,
                       registered with a router in another process (what a router benchmark drives)

It sits above the router (it runs the real router server and speaks the node protocol) and below
`bench`; tests/unit/test_layering.py checks it. Must never: be imported by a product part, build a
model (tests/conftest.py holds the shared model fixtures), or sleep where it waits for a condition.
"""
