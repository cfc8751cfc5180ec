"""Offload policies: allocation, retention, compensation (device-free)."""
