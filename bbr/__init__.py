"""The body-based router (BBR): an ext_proc service that routes on the request body's ``model``."""
