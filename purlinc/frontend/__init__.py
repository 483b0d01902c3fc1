"""The spec layer: parse (.pln -> AST), check (AST + R -> resolved spec), evaluate (NumPy oracle)."""
