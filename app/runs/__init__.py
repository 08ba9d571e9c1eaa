"""Many runs under one root: discovery, the run id in a URL, the per-run engines and the runs table."""
