"""Qwen2 in Flax/JAX: config, safetensors loading, device-mesh sharding and the extraction forward."""
