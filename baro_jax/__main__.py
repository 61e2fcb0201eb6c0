"""python -m baro_jax: the generation CLI (python -m baro_jax.generate)."""
import sys

from .generate import main

sys.exit(main())
