"""KV-cache eviction: one small class per policy (Keyformer, H2O, TOVA, SnapKV, window,
streaming), the scores they compute and Keyformer's noise, the budget's one unit, and the
retention each policy hands the engine to hold every layer's cache to its budget."""
