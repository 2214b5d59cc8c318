"""Linear probes and directions on stored activations: the rows a probe reads (``probing.rows``),
its fit and held-out score (``probing.fit``), the diff-in-means of the stored statistics
(``probing.directions``; the file that carries directions: ``activations.directions``), the results
and their chart (``probing.report``); ``python -m runners.probe`` runs them."""
