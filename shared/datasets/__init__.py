"""Data on disk: which files are images, the digits dataset, and the latent shard format (writer, index, reader, payload schema)."""
