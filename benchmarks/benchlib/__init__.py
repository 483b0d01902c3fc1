"""The benchmark's parts: ``bench.py`` (the command line) runs them, ``report.py`` re-reads
their results.  Modules that import torch are imported only once a run starts."""
