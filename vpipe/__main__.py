"""`python -m vpipe` (also what torchrun launches)."""

from vpipe.cli import main

raise SystemExit(main())
