"""What the default run uses but a learner need not read: the run's log and pictures, checkpoints,
the devices and process groups, the CPU shared-memory transport of fusion.py's switch, and each
mechanism file's companion (<file>_details.py: its checks, brakes, recovery, figures and hooks)."""
