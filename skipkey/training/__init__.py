"""Training SkipDecode for the shapes it serves: the schedule-shape study, and LoRA
fine-tuning with the layer policy in place (its recipe, batches, adapter plumbing and
checkpoints). Serving never imports this room."""
