"""`python -m extract`: ImageFolder scan (folder.py), ADM preprocessing (images.py), worker decoding
(loader.py), batched fp32 encoding into resumable shards (run.py) and the dataset check (check.py)."""
