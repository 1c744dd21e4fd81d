"""What the default run uses but a learner need not read: the run's log and pictures, checkpoints,
the devices and process groups, and the CPU shared-memory transport of fusion.py's switch."""
