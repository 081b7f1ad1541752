"""The trainer service: ``TrainerServicer`` (the TrainerService API over one ``TrainerEngine``) and
``build_trainer_service`` (load the model on a certified operator set)."""
