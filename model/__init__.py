"""One decoder for every supported family in Flax/JAX: config (``families/`` read Hugging Face configs),
safetensors loading, device-mesh sharding, the extraction forward, scoring, interventions, generation."""
