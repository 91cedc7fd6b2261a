"""KV beyond the device cache: the file tier a model's replicas share (file_tier.py, its
format in file_store.py), and the cost model that decides when reading beats computing."""
