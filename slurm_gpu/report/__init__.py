"""GPU accounting reports: sources, query planning, time windows, HTML."""
