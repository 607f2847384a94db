"""A run that heals itself (docs/reliability.md): each step's loss and gradient norm checked from the values the
step already reads (validation.py), a failed check attributed by re-running the step from the same state
(rerun.py: transient, genuine anomaly, persistent fault), Megatron-LM's fault injection (injection.py) and its
tracker file of rejected results (tracker.py). The flags are config/rerun.py's; training/trainer.py calls
RerunMachine.skips and run_step."""
