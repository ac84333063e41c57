"""KV-cache eviction: one small class per policy (Keyformer, H2O, TOVA, SnapKV, window,
streaming), their scores and noise, and the budgets that hold each layer's cache."""
