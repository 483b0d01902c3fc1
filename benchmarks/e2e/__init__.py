"""End-to-end benchmark: a tensor-parallel decode step (model, systems, launchers, results)."""
