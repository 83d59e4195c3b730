"""The static layout's step kind (`training_static`)."""
