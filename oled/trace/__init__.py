"""Routing traces: file format, recorder, synthetic traces, simulator and Belady bound."""
