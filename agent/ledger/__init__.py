"""The per-GPU ledger: the one authority on a GPU's devices, who holds them, and whether they
can be used (``ledger.py``), with one key space for a device however it is named
(``keys.py``)."""
