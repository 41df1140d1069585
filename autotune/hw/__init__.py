"""The hardware side of the tuner: which GPUs a run uses (``placement``) and what they did (``nvml``)."""
