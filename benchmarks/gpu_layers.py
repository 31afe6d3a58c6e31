"""The GPU layer table of issue 19 (see headmix.bench.gpu_layers): PYTHONPATH=src python3 benchmarks/gpu_layers.py [--tiny] [--device cpu]."""
import sys

from headmix.bench.gpu_layers import main

if __name__ == "__main__":
    sys.exit(main())
