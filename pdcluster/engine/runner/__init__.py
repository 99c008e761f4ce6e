"""The model runner: a scheduled step turned into the model's inputs, run, and sampled."""
