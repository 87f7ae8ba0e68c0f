"""The DFlash training recipe: target-generated data, random anchors, packed block attention,
exponentially decaying per-offset loss weights. See `data.py`, `anchors.py`, `trainer.py`."""
