"""Scan over layers (`scan_layers`): what both engines share. The ModuleList that runs as a loop (scanned_list.py),
which lists qualify and the layer traced (find.py), dropout drawn from keys (keyed_random.py). Each engine brings its
loop."""
