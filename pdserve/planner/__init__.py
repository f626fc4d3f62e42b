"""SLO planning: from a workload and two latency objectives to a cluster command line.

    step_cost.py   the step-time model (one formula for prefill, decode and mixed steps) and its fit
    profile.py     what the simulator needs of one node configuration on this machine, cached as JSON
    measure.py     `pdserve profile`'s measuring: the real engine's steps timed on the real model
    measure_stack.py  the router's, a node front's and a client's CPU per request and per token,
                   on a real local colocated cluster
    sim_node.py    one simulated node: the engine's own scheduler and KV cache manager on a simulated clock
    stack_load.py  the serving stack's share of the nodes' cores as a simulated run goes, and its stretch of a step
    simulator.py   the whole cluster as discrete events: the router's placement, the nodes, the KV hand-off
    goodput.py     a simulated run's SLO summary and the goodput search, as the serving bench computes them
    search.py      the configurations on N devices, each simulated and ranked
    validate.py    `--validate K`: the chosen candidates started and swept for real, predicted beside measured
    cpu_witness.py what else took the machine's CPU (steal, other processes) while a candidate was measured
    profile_cli.py `pdserve profile` (and the cached-or-measured lookup `pdserve plan` uses)
    cli.py         `pdserve plan`

Sits on top beside `bench` (whose workloads, metrics and goodput search it reuses, so a
prediction and a measurement use one definition) and imports the engine and the router's
placement policies below it; nothing imports it but the CLI.
"""
