"""The ext_proc wire layer: Envoy's messages in and out, and the gRPC server that carries them."""
