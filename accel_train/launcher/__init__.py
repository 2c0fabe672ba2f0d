"""The launcher: `python -m accel_train.launcher` (launch.sh, the ModelArts boot file, execs it).

It works out the job's layout from the platform (platforms.py) and the devices here (devices.py),
builds the `accelerate launch` command and its environment (command.py), runs each attempt and
watches its processes (attempt.py), and relaunches or exits as the ranks' reports decide
(policy.py)."""

# Every line the launcher says starts with this: it is what users type, and what their job logs have
# shown.
PREFIX = "launch.sh"


class LaunchError(Exception):
    """Bad input to the launcher: one line naming the fix, exit status 2, nothing started."""
