"""Where the program runs: the runtime a script declares for a TPU (`choice.py`), the device mesh and the partition
specs laid on it (`mesh.py`), and the hosts of a slice under the SPMD runtimes (`hosts.py`). Nothing is imported here:
`choice.py` is read by the launcher and the check before torch_xla starts, while `mesh.py` imports torch_xla."""
