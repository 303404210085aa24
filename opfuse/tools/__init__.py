"""The command line (demo, explain, bench, bisect) and its progress display."""
