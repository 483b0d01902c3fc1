"""The Atom layer: CUDA generation from Jinja templates per mechanism (ldst, tma), NVRTC, cache.

It knows nothing about which collective a schedule serves."""
