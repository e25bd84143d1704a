"""Ray Tune sweeps: tree budgets for one head (`budget`, the main job) and head architectures (`arch`)."""
