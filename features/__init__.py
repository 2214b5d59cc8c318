"""Features of stored activations: what a trained dictionary, a probe's directions or a site's raw
dimensions make of stored rows (``features.encoders``), for feature dashboards."""
