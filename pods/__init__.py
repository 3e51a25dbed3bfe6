"""The shared pod list: which model-server endpoints exist, as immutable snapshots."""
