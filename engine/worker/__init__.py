"""Running a step's plan: the model runner lays out the batch, runs the forward pass and
samples."""
