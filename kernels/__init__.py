"""Compute kernels; imported as ``vllm_infinitehip.kernels`` (see pyproject package-dir)."""
