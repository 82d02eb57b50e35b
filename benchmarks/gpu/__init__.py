"""The one-GPU check: a real P/D run on one NVIDIA GPU, compared with a colocated instance."""
