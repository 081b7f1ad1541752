"""RL job domain: the job spec users write, datasets, and the reward registry."""
