"""Memory helpers both engines and the benchmarks use: handing freed host
memory back to the operating system (`host.py`) and measuring the bytes
autograd saves for backward (`activations.py`)."""
