"""``python -m tensorplay_hpc.checkpoint info|export|import``."""
import sys

from .cli import main

sys.exit(main())
