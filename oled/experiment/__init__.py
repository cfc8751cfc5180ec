"""Experiments: build a runtime from a recipe, run workloads, track, report and tune."""
