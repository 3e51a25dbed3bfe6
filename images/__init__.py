"""Container images without a Docker daemon: an OCI image layout assembled in Python."""
