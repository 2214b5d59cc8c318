"""Features of stored activations: what a trained dictionary, a probe's directions or a site's raw
dimensions make of stored rows (``features.encoders``), each feature's top activating tokens over a
store, mergeable across workers (``features.top_activations``), and dashboards laid out as
Neuronpedia batch files (``features.neuronpedia``)."""
