"""The file in which a model folder that rlbus built describes itself (seed, warm-start steps,
held-out accuracy, the task it was warm-started on), beside its weights.

Kept apart from model_init.py (which imports torch) so that `rlbus up` can name it with cheap imports.
"""

MODEL_INFO_FILE = "rlbus_model.json"
