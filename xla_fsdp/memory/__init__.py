"""Memory helpers the engines and the benchmarks use: freed host memory handed back to the OS, activation bytes,
device HBM figures, "fit", and the recomputation policies (docs/DESIGN.md's layout table names each module)."""
