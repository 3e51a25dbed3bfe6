"""Serving an ext_proc handler: the gRPC server, the flags both services take, TLS, logs."""
