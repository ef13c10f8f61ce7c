"""Built-in backends, installed as ``quantcore.backends`` (one subpackage each)."""
