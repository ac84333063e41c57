"""SkipDecode: the depth schedules (layers each step runs), the layer policies that say which layers run,
the plan the engine calls, and the tuned LoRA adapter as a file."""
