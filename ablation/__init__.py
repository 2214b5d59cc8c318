"""Ablation experiments: a grid of interventions (``model.interventions``) run over a stream,
scored against the unablated model, tracked and plotted (``python -m runners.ablate``)."""
