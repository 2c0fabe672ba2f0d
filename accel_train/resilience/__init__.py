"""The lifecycle layer the loop calls: a stop asked by a signal or the launcher becomes one step
every rank agrees on, a lost or frozen peer is found in seconds, and the surviving machines save
the last completed step.

Modules: preempt (stop requests, the agreed checks, the launcher watch), survivor (the survivor
save), heartbeat (the ranks' heartbeat over UDP), device_copy (the survivor save's copy of the
training state off the device, no collective).
"""
