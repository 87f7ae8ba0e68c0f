"""Engine adapters: the only modules that import an engine (lazily)."""
