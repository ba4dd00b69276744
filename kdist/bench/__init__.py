"""Measurements: `kdist-bench` (`command`, `measure`, its input kinds and the CPU
record), several workers against one process (`workers`), and the peak memory
of a streamed epoch (`rss`). Nothing else in kdist imports this package."""
