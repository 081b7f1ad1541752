"""RL jobs: the job spec users write, datasets, rewards, and the GRPO loop the controller runs."""
