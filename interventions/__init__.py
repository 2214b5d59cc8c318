"""Interventions on the model as users write them (``--ablate``, a grid's ``--interventions``):
the spec language (``interventions.spec``) and a spec resolved into the arrays and per-token masks
the model takes (``interventions.resolve``), reading steering directions and token selections,
which the model itself never reads."""
