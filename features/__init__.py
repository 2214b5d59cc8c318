"""Features of stored activations: what a trained dictionary, a probe's directions or a site's raw
dimensions make of stored rows (``features.encoders``), and their dashboards: each feature's top
activating tokens (``features.top_activations``) and spread (``features.spread``: histogram and
activation intervals) over a store, both mergeable across workers; a feature's dashboard assembled
with its contexts and logit effects (``features.dashboard``), laid out as Neuronpedia batch files
(``features.neuronpedia``) and shown by an offline page (``features.viewer``)."""
