"""Report: what a compiled step will do, shown.

The report of predicted memory, communication and time (step_report.py), the
rates time is predicted with (calibrate.py), per-pass dumps (dump.py), the
timeline picture (timeline.py) and the Chrome trace (trace_events.py).
"""
