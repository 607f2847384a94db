"""Run reporting: the log line and the TensorBoard / wandb scalars (logger.py, training_log.py), the timers,
throughput and MFU, and the run's closing summary."""
