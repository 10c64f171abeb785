"""`python -m tinyvit` is the `tinyvit` command."""
import sys

from .cli import main

sys.exit(main())
