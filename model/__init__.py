"""One decoder for every supported family in Flax/JAX: config (``families/`` read Hugging Face configs),
safetensors loading, device-mesh sharding, the extraction forward, scoring, interventions, generation.

Importing it sets the XLA flags the project needs (``model.xla_flags``) before JAX starts a backend."""

from model import xla_flags

xla_flags.apply()
