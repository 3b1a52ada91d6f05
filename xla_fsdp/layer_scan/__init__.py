"""Scan over layers (`scan_layers`): what both engines share (docs/DESIGN.md lists the files); each engine brings its
loop."""
