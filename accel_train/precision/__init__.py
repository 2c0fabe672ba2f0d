"""The precision check: before the first step, a reduced precision (bf16, fp16) must compute this
model's gradients right on this device, or the run falls back to fp32 (docs/speed.md: Precision).

Modules: check (the check itself, on one real batch and on each layer alone), verdict (what one rank
found, the ranks' verdicts combined, what a failure says), cache (the verdicts remembered across
runs).

"""
