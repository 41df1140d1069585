"""The DDP job that torchrun launches (`python -m trainer`). Never imports autotune or optuna."""
