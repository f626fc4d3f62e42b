"""The bottom layer: small utilities every part may use (cache paths, the shared-secret auth,
the reconnect options of long-lived gRPC channels, the /metrics HTTP endpoint, CPU pinning, the
internal messages' codec). It imports no other pdserve part, and importing this package imports
none of its modules."""
