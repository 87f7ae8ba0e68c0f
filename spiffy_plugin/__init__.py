"""Spiffy: lossless speculative decoding for block-diffusion LLMs.

So far: the block-diffusion runtime Spiffy accelerates (`runtime.BlockDiffusionRunner`, exact
KV caching of committed blocks, several candidate blocks per forward) and vanilla / threshold
decoding (`decode.generate`) with NFE counts. Draft graphs, calibration and verification follow.
"""
