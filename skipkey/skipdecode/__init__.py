"""SkipDecode: the depth schedules (how many layers each step runs) and their measured
shapes, the layer policies that say which layers run, the plan the engine calls, and the
tuned LoRA adapter as a file."""
