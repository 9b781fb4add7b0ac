"""Quality-benchmark datasets: the instance schema, and loaders for public benchmark files."""
