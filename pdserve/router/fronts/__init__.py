"""What reaches the router from outside: the gRPC server and `pdserve router` (server.py), the
OpenAI-compatible HTTP front (http_server.py, openai_api.py), Prometheus metrics (metrics.py)
and the `pdserve generate` client (client.py). The top floor: may import every other group."""
