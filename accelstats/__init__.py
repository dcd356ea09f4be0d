"""accelstats: per-container accelerator metrics."""

__version__ = "0.1.0"
