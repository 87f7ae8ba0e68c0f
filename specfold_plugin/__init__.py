"""SpecFold: residual-gated folded verification on top of Spiffy.

Pure-torch reference: `gate` (gate, resolve_sources), `attention` (streaming states and their
merge), `fold` (folded verify forward of Qwen3 layers), `specfold.specfold_generate`, CLI
`specfold generate`. Triton kernels that mirror the gate / source / attention-state functions
live in `kernels/`.
"""
