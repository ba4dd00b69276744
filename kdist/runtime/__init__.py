"""Process set-up that runs before any framework loads: device counts, log levels,
the frameworks' quiet import (`startup`) and heap settings (`memory`)."""
