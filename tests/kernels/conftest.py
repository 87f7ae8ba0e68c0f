"""Kernel tests: compiled on a GPU, else under TRITON_INTERPRET=1.

Triton picks interpreter or compiler when a function is decorated, and tests/conftest.py already
imports triton (through transformers) before this folder is collected. So on a CPU-only machine
the test modules here skip themselves unless the variable was set at process start, and
test_interpreter.py re-runs this folder in a subprocess with TRITON_INTERPRET=1."""
