"""The training loop and what it stands on: the rectified-flow objective, timestep and LR schedules,
streaming the packed train set, FSDP2 x TP, REPA, EMA, Muon, checkpoints (DCP, signed manifests,
safetensors exports), PMA and telemetry. Imports nothing else of training/."""
