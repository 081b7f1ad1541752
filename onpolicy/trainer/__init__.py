"""The trainer engine: the training-path forward (teacher-forced, packed) and, later, RL steps."""
