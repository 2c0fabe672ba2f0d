"""What the run runs on, asked of Accelerate and the device: the Accelerator for the platform,
the device's facts, the CPU cores a process may use, what the collective backend reads from the
environment, and the checks that make every rank agree.

Modules: accelerator, hardware, cores, backend_env, accel_config (an accelerate config checked with
accelerate's own loader, for the launcher), ranks (one error said once, rank 0's choice).
"""
