"""KV tiers; imported as ``vllm_infinitehip.block_manager`` (see pyproject package-dir)."""
