"""MoE Workbench: see, place and run the experts of Mixture-of-Experts models on one machine."""

__version__ = "0.1.0"
