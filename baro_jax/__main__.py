"""python -m baro_jax: the generation CLI (baro_jax/generate.py)."""
import sys

from .generate import main

if __name__ == "__main__":
    sys.exit(main())
