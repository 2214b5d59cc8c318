"""Entry points that drive the model on a host (``python -m runners.<name>``)."""
