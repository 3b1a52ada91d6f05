"""The collective engine's loop for scanned units (`scan_loop.py`) and their shards stored stacked (`stacked_units.py`).
Part of the collective engine (tests/test_layout.py's rooms), kept here with the rest of scan over layers."""
