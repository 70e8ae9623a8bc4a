"""The measuring harness shared by ``benchmarks/`` and notebook 04: neither the kit's training path nor the notebook layer."""
