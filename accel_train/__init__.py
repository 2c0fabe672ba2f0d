"""accel_train: one training loop, any platform, through Hugging Face Accelerate."""

__version__ = "0.1.0"
