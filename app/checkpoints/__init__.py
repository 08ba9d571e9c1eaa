"""The checkpoint browser: which sets every rank can resume from, and how; download, delete, verify."""
