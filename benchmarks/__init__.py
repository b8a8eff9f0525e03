"""asv regression suite for vpipe (asv.conf.json's benchmark_dir): asv imports every module here, so
this folder holds the suite alone; the evaluation scripts are in bench/."""
