"""asv benchmark suite for vpipe (see asv.conf.json at the repository root)."""
