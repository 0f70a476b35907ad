"""mistill: which attention heads carry each label decision, and can a student be taught them.

The library is importable without MLflow (GPU benchmark machines have none); only
``mistill.tracking`` imports it.
"""

__version__ = "0.1.0"
