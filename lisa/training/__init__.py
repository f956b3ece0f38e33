"""Training: the training loops, drafter training, distillation, the logit cache, calibration."""
