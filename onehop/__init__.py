"""One hop: BBR's chain and the model's pool's pick in one ext_proc stream, above both services."""
