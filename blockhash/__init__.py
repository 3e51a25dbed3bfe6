"""Block hashes as the model servers compute them: the picker reads them, the simulator writes
them, and neither owns them (``blockhash.vllm``: vLLM's)."""
