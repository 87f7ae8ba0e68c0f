"""SpecFold: residual-gated folded verification on top of Spiffy (not implemented yet)."""
