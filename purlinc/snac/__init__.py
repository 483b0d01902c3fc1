"""The SNAC layer: schedule IR, lowering per algorithm, verifier, simulator.

It knows nothing about which Atom (GPU mechanism) runs a schedule."""
