"""The stored product: shard files, their Parquet index and the reader API."""
