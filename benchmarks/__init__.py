"""dilax benchmark CLI: ``python -m benchmarks {speed,memory,scaling,max-seq,demo,all}``."""
