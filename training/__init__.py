"""How tiny-arena-vl is trained: scripts run from the repository root as modules, e.g.
``python -m training.train_arena --help`` (the package ``kv_arena`` installed, ``pip install -e .``)."""
