"""The Atom layer: the atom registry (``atoms``: ldst, tma, ce), CUDA generation from Jinja
templates for the kernel atoms, NVRTC, the compile cache, and the host-driven copy-engine
atom (``ce``).

It knows nothing about which collective a schedule serves, and never imports the runtime."""
