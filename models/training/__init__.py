"""Training and data generation for the committed weights: the target answering prompts, the drafts distilled from
those answers, the exit adapter from the target's hidden states, and their evaluation. `make models RETRAIN=1` runs
the whole recipe (models/training/recipe.py); docs/training.md says how the committed weights were made."""
