"""Entry points of the Beam pipelines (``python -m pipeline.prepare``, ``python -m pipeline.index``)."""
