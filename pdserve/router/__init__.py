"""The router, in four groups on import floors, each importing only the floors below it:

    router/ itself   config.py, errors.py, model.py: what every group reads
    cluster/         the cluster view: node registry, liveness, node facts, placement policies
    requests/        one request: validation (with a beam search's option), admission, the token
                     relay, merged sample streams
    dispatch/        sending requests to nodes: the shared state, the sample driver, its routes,
                     recovery, served beam search, the orchestrator
    fronts/          what clients and operators reach: the gRPC server, the OpenAI HTTP front,
                     metrics, the `pdserve generate` client

tests/unit/test_layering.py fails on an import up a floor.
"""
