"""The GSPMD engine's loop for scanned layers (`scan.py`), its glue to torch_xla's `scan` (`scan_glue.py`) and the
layers' parameters stored stacked (`stacked.py`). Part of the GSPMD engine (tests/test_layout.py's rooms), kept here
with the rest of scan over layers."""
