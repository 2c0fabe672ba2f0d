"""The training loop and what it calls at its named moments: start-up builds the run, the loop
steps, checks with the other ranks, evaluates and saves, and the run's outputs are written at the
end.

Modules: loop (train(): epochs, steps, the end of an epoch), startup (start-up in phases -> Run),
evaluate (the whole split, gathered over ranks), optim (timm's optimizer, schedule and loss),
metrics (the epoch meter, metrics.jsonl, the trackers), exports (model.safetensors, the EMA and
best-epoch exports, the curves), divergence (the divergence watch).
"""
