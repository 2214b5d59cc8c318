"""Ablation experiments: a grid of interventions (``interventions.spec``) run over a stream,
scored against the unablated model, tracked and plotted (``python -m runners.ablate``)."""
