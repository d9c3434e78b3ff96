"""Data on disk: which files are images and how a folder's are found (the ImageFolder scan, copies), the digits
dataset, the latent shard format (writer, index, reader, payload schema) and its sha256 verification."""
