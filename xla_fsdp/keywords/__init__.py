"""The front door's keywords: `table.py` the one table (each keyword's default, whose it is, the doors that take it,
what it does here), `resolve.py` defaults filled in, torch_xla's spellings mapped, contradictions refused, and the typed
options they become. Nothing is imported here: the config package reads `table.py` at load (tests/test_layout.py)."""
