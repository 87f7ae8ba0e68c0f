"""Spiffy: lossless speculative decoding for block-diffusion LLMs (not implemented yet)."""
