"""Checkpoints and the output directory they live in: what is saved and loaded, which step a job
resumes from and what a resume may change, who owns the output directory, and a checkpoint sent to
the machines whose disk lacks it.

Modules: checkpointer (Checkpointer: atomic saves, the newest K kept, loading), resume (one resume
decision per job, elastic resume), changes (each flag refused, taken from the resumed step, or free
on resume), output_dir (the runs an output dir holds, --overwrite, the run's math, the lock),
transfer (a checkpoint sent at start-up).
"""
