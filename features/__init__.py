"""Features of stored activations: what a trained dictionary, a probe's directions or a site's raw
dimensions make of stored rows (``features.encoders``), and each feature's top activating tokens
over a store, mergeable across workers (``features.top_activations``), for feature dashboards."""
