"""Everything TPU-specific: slice topologies, chip facts, and the ahead-of-time compile through libtpu's own
compiler (which needs no TPU attached). Nothing here loads libtpu or jaxlib at import time; they come with
`pip install -e .[tpu-aot]`."""
