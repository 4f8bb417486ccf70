"""The parts of benchmarks/detection_quality.py, one module each."""
