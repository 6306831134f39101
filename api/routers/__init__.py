"""HTTP routes, one module per group: health, control, checkpoints, predict."""
