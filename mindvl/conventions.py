"""Constants that several rooms must agree on, defined once. A leaf module (no imports) so every room may use it:
`data` and `models` may not import each other, yet both must mean the same by an untrained label.
"""

IGNORE_INDEX = -100  # a label that is not trained (transformers' convention; torch's cross_entropy default)
MODULES = ("visual", "projector", "language_model")  # MindVL's top-level modules, as recipes and metrics name them
