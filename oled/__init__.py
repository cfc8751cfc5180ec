"""OLED-MoE: MoE diffusion language models on GPUs too small to hold all experts."""

__version__ = "0.1.0"
