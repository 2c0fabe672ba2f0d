"""The commands beside training, each run by `accel-train <command>` (cli.COMMANDS):

evaluate.py  accuracy and per-class accuracy of a finished run's model (any number of ranks)
predict.py   top-k classes for image files
preflight.py what a launch will start, checked before it starts (launch.sh runs it)
smoke.py     Accelerate's own test script, passing only when the ranks formed the config's group
"""
