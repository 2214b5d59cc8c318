"""Beam PTransforms and DoFns of the project, each with its per-element logic as plain functions."""
