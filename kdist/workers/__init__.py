"""Processes and workers: which workers take part (`cluster`), starting and
supervising processes (`processes`) and the stop every worker agrees on
(`interrupt`). Imports no framework."""
